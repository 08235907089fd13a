"""LMCache's own L1 manager and L2 adapters, driven as its storage controllers drive them:
an adapter built from its JSON spec (``"serde"`` included) and wrapped by LMCache's
``SerdeL2AdapterWrapper`` exactly as ``StorageManager._build_l2_adapter`` does, then chunks
stored and loaded through it. Also a throwaway Redis server on loopback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import torch


def _l2():
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper
    from lmcache.v1.distributed.serde import create_serde_processor

    import kakeyaturbo.lmcache  # noqa: F401  (registers the kakeya serde)

    return create_l2_adapter, SerdeL2AdapterWrapper, create_serde_processor


def parse_spec(spec: dict):
    """The adapter config LMCache's own ``--l2-adapter <JSON>`` parsing makes of ``spec``."""
    import argparse
    import json

    from lmcache.v1.distributed.l2_adapters.config import (
        add_l2_adapters_args,
        parse_args_to_l2_adapters_config,
    )

    parser = add_l2_adapters_args(argparse.ArgumentParser())
    args = parser.parse_args(["--l2-adapter", json.dumps(spec)])
    return parse_args_to_l2_adapters_config(args).adapters[0]


def make_l1(size_bytes: int = 1 << 30):
    from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
    from lmcache.v1.distributed.l1_manager import L1Manager

    mem = L1MemoryManagerConfig(size_in_bytes=size_bytes, use_lazy=False, shm_name="")
    return L1Manager(L1ManagerConfig(memory_config=mem))


class Tier:
    """One L2 adapter from its JSON ``spec`` behind LMCache's serde wrapper."""

    def __init__(self, spec: dict, l1=None) -> None:
        create, wrapper, serde = _l2()
        self.l1 = l1 if l1 is not None else make_l1()
        config = parse_spec(spec)
        inner = create(config, self.l1.get_l1_memory_desc())
        self.inner = inner
        self.adapter = inner
        if config.serde_config is not None:
            self.adapter = wrapper(inner, serde(config.serde_config), self.l1)

    def close(self) -> None:
        self.adapter.close()

    def _objects(self, keys, shape, dtype):
        from lmcache.v1.distributed.api import MemoryLayoutDesc

        layout = MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[dtype])
        res = self.l1.reserve_write(keys, [False] * len(keys), layout, tag="test")
        objs = []
        for k in keys:
            err, obj = res[k]
            if obj is None:
                raise RuntimeError(f"L1 reserve_write failed: {err}")
            objs.append(obj)
        return objs

    def store(self, chunks: dict, timeout: float = 120.0) -> None:
        """``chunks``: ObjectKey -> KV tensor ``[2, L, T, hidden]``; raises if not stored."""
        keys = list(chunks)
        first = chunks[keys[0]]
        objs = self._objects(keys, first.shape, first.dtype)
        for k, o in zip(keys, objs):
            o.tensor.view(first.shape).copy_(chunks[k])
        self.l1.finish_write_and_reserve_read(keys, tag="test")
        tid = self.adapter.submit_store_task(keys, objs)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                done = self.adapter.pop_completed_store_tasks()
                if tid in done:
                    if not done[tid].is_successful():
                        raise RuntimeError("L2 store failed")
                    return
                time.sleep(0.005)
            raise TimeoutError("L2 store did not finish")
        finally:
            self.l1.finish_read(keys)
            self.l1.delete(keys)

    def load(self, keys: list, shape, dtype, timeout: float = 120.0) -> list:
        """The chunks of ``keys`` loaded back (None where the tier reports a miss)."""
        from lmcache.v1.distributed.api import ObjectKey

        dst_keys = [ObjectKey(k.chunk_hash + b"-dst", k.model_name, k.kv_rank) for k in keys]
        objs = self._objects(dst_keys, shape, dtype)
        tid = self.adapter.submit_load_task(keys, objs)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                bitmap = self.adapter.query_load_result(tid)
                if bitmap is not None:
                    return [
                        o.tensor.view(shape).clone() if bitmap.test(i) else None
                        for i, o in enumerate(objs)
                    ]
                time.sleep(0.005)
            raise TimeoutError("L2 load did not finish")
        finally:
            self.l1.finish_write_and_delete(dst_keys, tag="test")


def chunk_keys(n: int, model: str = "smollm2", salt: bytes = b"") -> list:
    from lmcache.v1.distributed.api import ObjectKey

    return [ObjectKey(salt + i.to_bytes(8, "big"), model, 0) for i in range(n)]


def split_chunks(kv: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """``[2, L, T, hidden]`` -> LMCache's chunks of ``chunk`` tokens (the last may be short)."""
    return [kv[:, :, i : i + chunk].contiguous() for i in range(0, kv.shape[2], chunk)]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def redis_binary() -> str | None:
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name) or (
            f"/usr/bin/{name}" if os.path.exists(f"/usr/bin/{name}") else None
        )
        if found:
            return found
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A Redis/Valkey server on loopback on a free port, no persistence, stopped on exit."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = _free_port()
        self.dir = tempfile.mkdtemp(prefix="kt-redis-")
        self.proc = None

    def __enter__(self) -> RedisServer:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--protected-mode",
            "yes",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.command("PING") == "+PONG":
                    return self
            except OSError:
                time.sleep(0.05)
        self.__exit__()
        raise RuntimeError(f"{self.binary} did not start on port {self.port}")

    def command(self, *parts: str) -> str:
        """One inline command, its first reply line (enough for PING, DBSIZE, MEMORY...)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall((" ".join(parts) + "\r\n").encode())
            return s.recv(65536).decode(errors="replace").split("\r\n")[0]

    def value_bytes(self) -> int:
        """Sum of STRLEN over every key: the bytes the store holds for the objects."""
        import redis  # the client LMCache depends on

        r = redis.Redis(host="127.0.0.1", port=self.port)
        try:
            return sum(int(r.strlen(k)) for k in r.scan_iter(count=1000))
        finally:
            r.close()

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
