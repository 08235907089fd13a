"""The reference model laid out as vLLM lays out a Llama, for testing the vLLM hooks on CPU.

vLLM itself needs a CUDA GPU, so the hook tests run the real kt-ref-a weights through modules
that keep vLLM 0.32's contract, the part the hooks rely on, line for line:

* ``LlamaAttention.forward(positions, hidden_states)`` is vLLM's body verbatim (merged
  ``qkv_proj``, split, ``self.rotary_emb(positions, q, k)``, ``self.attn(q, k, v)``);
* the rotary embedding is one instance shared by every layer (vLLM's ``get_rope`` cache) and
  rotates ``query``/``key`` in place, as vLLM's CUDA kernel does;
* ``Attention.forward(query, key, value)`` takes ``[tokens, heads * head_dim]`` rows of every
  scheduled sequence stacked, writes K/V into a paged cache at the forward's slots, and
  attends by reading K/V back from that cache;
* the model's ``forward(input_ids, positions)`` is what vLLM's model runner calls.

``tests/integration/test_vllm_hooks.py`` checks first that this model reproduces
transformers' logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig


@dataclass
class StepContext:
    """What vLLM's forward context carries that this attention needs: where each scheduled
    token's K/V go (slot) and which cached slots each sequence attends to."""

    slots: torch.Tensor  # [tokens] cache slot of each new token
    seq_rows: list[tuple[int, int]]  # row range of each sequence in the forward
    seq_slots: list[torch.Tensor]  # every slot of each sequence, oldest first, new ones included


_CTX: list[StepContext] = []


class RotaryEmbedding(torch.nn.Module):
    """Neox-style (half-split) RoPE; rotates query and key in place and returns them."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> None:
        t = x.view(x.shape[0], -1, self.head_dim)
        ang = positions.float()[:, None] * self.inv_freq[None]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        a, b = t[..., : self.head_dim // 2].clone(), t[..., self.head_dim // 2 :].clone()
        t[..., : self.head_dim // 2] = a * cos - b * sin
        t[..., self.head_dim // 2 :] = b * cos + a * sin

    def forward(self, positions, query, key=None):
        self._rotate(query, positions)
        if key is not None:
            self._rotate(key, positions)
        return query, key


class Attention(torch.nn.Module):
    """A paged-cache decoder attention with vLLM's ``Attention`` interface."""

    def __init__(self, num_heads, head_size, num_kv_heads, layer_name, num_slots):
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.layer_name = layer_name
        self.impl = "paged-sdpa"
        self.attn_type = "decoder"
        self.kv_sharing_target_layer_name = None
        self.key_cache = torch.zeros(num_slots, num_kv_heads, head_size)
        self.value_cache = torch.zeros(num_slots, num_kv_heads, head_size)
        self.calls = 0

    def forward(self, query, key, value, output_shape=None):
        self.calls += 1
        ctx = _CTX[-1]
        self.key_cache[ctx.slots] = key.view(-1, self.num_kv_heads, self.head_size)
        self.value_cache[ctx.slots] = value.view(-1, self.num_kv_heads, self.head_size)
        q = query.view(-1, self.num_heads, self.head_size)
        out = torch.empty_like(q)
        rep = self.num_heads // self.num_kv_heads
        for (s, e), slots in zip(ctx.seq_rows, ctx.seq_slots):
            k = self.key_cache[slots].repeat_interleave(rep, dim=1).transpose(0, 1)
            v = self.value_cache[slots].repeat_interleave(rep, dim=1).transpose(0, 1)
            n, total = e - s, len(slots)
            # causal: new row i sees every cached slot up to its own position
            mask = torch.ones(n, total, dtype=torch.bool).tril(total - n)
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k, v, attn_mask=mask, scale=1 / math.sqrt(self.head_size)
            )
            out[s:e] = o.transpose(0, 1)
        return out.reshape(-1, self.num_heads * self.head_size)


class RMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(weight, requires_grad=False), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Linear(torch.nn.Module):
    """vLLM's parallel linears return (output, bias)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return x @ self.weight.T, None


class LlamaAttention(torch.nn.Module):
    def __init__(self, cfg, w, i, rotary, num_slots):
        super().__init__()
        p = f"model.layers.{i}.self_attn."
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = _Linear(
            torch.cat([w[p + "q_proj.weight"], w[p + "k_proj.weight"], w[p + "v_proj.weight"]])
        )
        self.o_proj = _Linear(w[p + "o_proj.weight"])
        self.rotary_emb = rotary
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            f"model.layers.{i}.self_attn.attn",
            num_slots,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        output, _ = self.o_proj(attn_output)
        return output


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg, w, i, rotary, num_slots):
        super().__init__()
        p = f"model.layers.{i}."
        self.input_layernorm = RMSNorm(w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, w, i, rotary, num_slots)
        self.post_attention_layernorm = RMSNorm(
            w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps
        )
        self.gate_up_proj = _Linear(
            torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        )
        self.down_proj = _Linear(w[p + "mlp.down_proj.weight"])

    def forward(self, positions, h):
        h = h + self.self_attn(positions, self.input_layernorm(h))
        gu, _ = self.gate_up_proj(self.post_attention_layernorm(h))
        g, u = gu.chunk(2, dim=-1)
        out, _ = self.down_proj(F.silu(g) * u)
        return h + out


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, model_dir: str | Path, num_slots: int = 4096):
        super().__init__()
        cfg = AutoConfig.from_pretrained(model_dir)
        w = load_file(str(Path(model_dir) / "model.safetensors"))
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters["rope_theta"])
        self.embed = w["model.embed_tokens.weight"]
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, w, i, rotary, num_slots) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(w["model.norm.weight"], cfg.rms_norm_eps)
        self.lm_head = w.get("lm_head.weight", self.embed)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed[input_ids]
        for layer in self.layers:
            h = layer(positions, h)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head.T


@dataclass
class Engine:
    """Schedules sequences onto the paged cache and runs one forward per step."""

    model: LlamaForCausalLM
    slots_of: dict[int, list[int]] = field(default_factory=dict)
    next_slot: int = 0

    @torch.inference_mode()
    def step(self, batch: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """``batch``: (sequence id, new token ids) per sequence; returns each one's logits."""
        ids, pos, slots, rows, seq_slots = [], [], [], [], []
        for seq, toks in batch:
            have = self.slots_of.setdefault(seq, [])
            new = list(range(self.next_slot, self.next_slot + len(toks)))
            self.next_slot += len(toks)
            rows.append((len(ids), len(ids) + len(toks)))
            pos.extend(range(len(have), len(have) + len(toks)))
            have.extend(new)
            ids.extend(toks)
            slots.extend(new)
            seq_slots.append(torch.tensor(have))
        _CTX.append(StepContext(torch.tensor(slots), rows, seq_slots))
        try:
            hidden = self.model(input_ids=torch.tensor(ids), positions=torch.tensor(pos))
        finally:
            _CTX.pop()
        logits = self.model.compute_logits(hidden)
        return [logits[s:e] for s, e in rows]

    def cached(self, seq: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) the cache holds for ``seq`` in ``layer``: [tokens, kv_heads, D]."""
        attn = self.model.layers[layer].self_attn.attn
        slots = torch.tensor(self.slots_of[seq])
        return attn.key_cache[slots].clone(), attn.value_cache[slots].clone()
