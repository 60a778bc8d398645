"""Shared by the JAX-path tests: a decode step of distinct requests over
a resident prefix, and the compile option the tests trade step speed for."""
import numpy as np

from golden.compose import Session
from golden.paged import DECODE, Span, lower
from twin.abi import constants as C

OPT0 = {"xla_backend_optimization_level": 0}        # compile time over step speed


def session(ckpt, cfg, requests, prefix):
    """requests distinct requests, `prefix` tokens resident, then one decode step of 8 rows each."""
    s = Session(ckpt, cfg, "device", requests, prefix + C.DECODE_SEQ)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (requests, prefix + C.DECODE_SEQ))
    s.run({r: ids[r, :prefix] for r in range(requests)})
    meta = lower(cfg, [Span(r, prefix, tuple(ids[r, prefix:]), s.blocks[r]) for r in range(requests)], form=DECODE)
    return s, meta
