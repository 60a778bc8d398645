"""Generate docs/abi.md from the ABI description.  `python -m twin.abi.docgen --write` rewrites it;
a test fails when the committed page is stale."""
from __future__ import annotations

import argparse
from pathlib import Path

from . import constants as C
from .caches import cache_families, size_families
from .presets import PRESETS, config_field_names
from .programs import PROGRAMS, bind
from .ringheap import DEFAULT_PROFILES, ENV_VARS
from .topology import PRODUCTION_TOPOLOGIES, SMALL_PRESET_TOPOLOGIES, deployment

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "abi.md"


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def render() -> str:
    flash = deployment("flash", ep=16, max_model_len=1024, long_prefill_token_threshold=128,
                       max_num_batched_tokens=8192)
    L: list[str] = [
        "# ABI reference", "",
        "Generated from `twin.abi` by `python -m twin.abi.docgen --write`; do not edit by hand "
        "(`tests/abi/test_docs.py` fails when this page is stale).", "",
        "## Presets", "",
        "FLASH mirrors the DeepSeek-V4-Flash checkpoint config; TINY and SMALL keep its structure at CPU sizes.", "",
    ]
    names = list(PRESETS)
    L += _table(["field"] + names, [[f] + [repr(getattr(PRESETS[n], f)) if f != "compress_ratios"
                                           else "len %d: %s" % (len(PRESETS[n].compress_ratios),
                                                               "".join("S" if r == 0 else ("C" if r == 4 else "H")
                                                                       for r in PRESETS[n].compress_ratios))
                                           for n in names] for f in config_field_names()])
    L += ["", "Compress-ratio key: S = SWA only (0), C = CSA (4), H = HCA (128); the last entry is the MTP layer.", ""]
    L += ["## Topologies", "",
          f"- Production (every preset): (tp, ep) in {list(PRODUCTION_TOPOLOGIES)}, dp = ep/tp cache partitions.",
          f"- Small presets only: also {[t for t in SMALL_PRESET_TOPOLOGIES if t not in PRODUCTION_TOPOLOGIES]} "
          "(a single TP group, or a single rank) so whole models run on a CPU.",
          f"- block size {C.BLOCK_SIZE}; max_num_seqs <= {C.DECODE_BATCH} x partitions; max_model_len <= "
          f"{C.MAX_MODEL_LEN_CEILING:,} and <= max_position_embeddings; K in {list(C.SUPPORTED_K)}; temperature 0 only.",
          "- max_prefill_tokens_per_request = min(8192, max_num_batched_tokens, long_prefill_token_threshold "
          "if chunked prefill); replay tokens = 128 when K > 0.", ""]
    L += ["## Cache families", "",
          "At the FLASH binding, max_model_len 1024, chunk 128 (bytes per page and max blocks per request):", ""]
    sizing = size_families(flash.model, 1024, 128)
    rows = []
    for f in cache_families(flash.model):
        s = sizing[f.name]
        rows.append([f"`{f.name}`", len(f.layers), f.page_tokens, f.rows_per_page, f.row_bytes, f"{f.page_bytes:,}",
                     "full history" if f.window is None else f"rolling {f.window}", s.max_blocks_per_seq,
                     f"{s.frozen_depth:,}", ", ".join(f"`{t.name}`" for t in f.tensors)])
    L += _table(["family", "layers", "tokens/page", "rows/page", "row bytes", "page bytes", "kind",
                 "blocks/request", "frozen depth", "device tensors"], rows)
    L += ["", "Full-history: ceil(max_seq_len / 128) pages. Rolling: ceil((window - 1 + in_flight) / page) + 1, "
          "in_flight = max(min(chunk, max_seq_len), 8). Pools hold slots x blocks + 64 scratch pages per layer.", ""]
    L += ["## Ring heaps", ""]
    L += _table(["profile", "GiB per depth 0..3", "override"],
                [[k, ", ".join(f"{v / C.GIB:g}" for v in vals), ENV_VARS.get(k, "--ring-heap" if k == "prefill" else "none")]
                 for k, vals in DEFAULT_PROFILES.items()])
    L += ["", "Override grammar: one byte count (broadcast) or four comma-separated; nonzero entries powers of two "
          ">= 1024; 0 keeps the runtime default.", ""]
    L += ["## Programs", "",
          "Shapes are bound at FLASH, EP16, max_model_len 1024, chunk 128, one slot; dynamic axes at their "
          "maxima (P 8192, L 2048, Q 64, B 16, T_MAIN 128).", ""]
    L += _table(["program", "compiled as", "args", "ring heap", "compiled for K"],
                [[f"`{p.name}`", p.compiled_as, len(p), p.ring_heap, ", ".join(map(str, p.modes)) or "legacy"]
                 for p in PROGRAMS.values()])
    for p in PROGRAMS.values():
        L += ["", f"### `{p.name}` ({len(p)} args)", ""]
        L += _table(["#", "name", "symbolic shape", "FLASH shape", "dtype", "role", "dynamic", "buffer"],
                    [[i + 1, f"`{b.name}`", b.arg.shape, "[" + ", ".join(map(str, b.shape)) + "]", b.dtype, b.arg.role,
                      b.arg.dyn or "", "" if b.arg.buffer_id == b.name else f"`{b.arg.buffer_id}`"]
                     for i, b in enumerate(bind(p, flash))])
    return "\n".join(L) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help=f"write {DOC_PATH}")
    a = ap.parse_args()
    text = render()
    if a.write:
        DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
        DOC_PATH.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
