"""Encoding and decoding from several Python threads at once (the GIL is released inside
the core) gives results identical to a single-threaded run."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

import kakeyaturbo as kt


def test_concurrent_encode_decode_is_identical(real_kv):
    inputs = [real_kv[f"layer{i}.{s}"] for i in range(6) for s in ("k", "v")]
    params = [kt.CodecParams(bit_width=2 + (i % 3), seed=i) for i in range(len(inputs))]
    serial = [kt.encode_batch(x, p) for x, p in zip(inputs, params)]
    serial_bytes = [[e.to_bytes() for e in encs] for encs in serial]
    serial_dec = [kt.decode_batch(encs) for encs in serial]

    def work(i):
        encs = kt.encode_batch(inputs[i], params[i])
        single = [
            kt.decode_layer(kt.encode_layer(np.ascontiguousarray(x), params[i])) for x in inputs[i]
        ]
        return [e.to_bytes() for e in encs], kt.decode_batch(encs), single

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(work, list(range(len(inputs))) * 2))
    for j, (b, dec, single) in enumerate(results):
        i = j % len(inputs)
        assert b == serial_bytes[i]
        np.testing.assert_array_equal(dec, serial_dec[i])
        np.testing.assert_array_equal(np.stack(single), serial_dec[i])
