"""Constants frozen by the PyPTO-Lib kernels and the serving runner.

These are facts of the device contract, not tunables: a staged table shallower than its frozen
depth poisons an AICore lane (507901), a request tile larger than its capacity raises in the
runner.  Everything else in the twin reads them from here.
"""
from __future__ import annotations

MAX_MODEL_LEN_CEILING = 1_048_576      # 1M-token context ceiling
BLOCK_SIZE = 32                        # --block-size must be 32
TP_SIZE = 4                            # ranks per TP group (= cache partition)
COMPRESSED_BLOCK_TOKENS = 128          # source tokens per compressed page (cmp_c128, cmp_c4, idx)
SLIDING_WINDOW = 128                   # raw-KV window; also the K=7 prefix-cache replay
SPEC_REPLAY_TOKENS = 128               # speculative_prefix_cache_replay_tokens when K > 0
SCRATCH_PAGES = 64                     # kernel padding pages per group per partition replica

# frozen table depths (kernel constants)
ORI_MAX_BLOCKS = 32768                 # 1M / 32
CMP_MAX_BLOCKS = 8192                  # 1M / 128 (cmp_c128, cmp_c4, idx)
HCA_STATE_MAX_BLOCKS = 131072          # 1M / 8
CSA_STATE_MAX_BLOCKS = 524288          # 1M / 2
SPLIT_DECODE_CSA_STATE_DEPTH = 8       # 16-position transaction ring (8 pages of 2)

# request and row capacities
DECODE_BATCH = 64                      # requests per TP group per decode step (also max slots)
DECODE_SEQ = 8                         # rows verified per request per step (1 + 7 drafts)
DECODE_TOKENS = DECODE_BATCH * DECODE_SEQ   # 512-row decode tile per group
LOCAL_REQUESTS = DECODE_BATCH // TP_SIZE    # 16 requests per owner rank
LOCAL_ROWS = LOCAL_REQUESTS * DECODE_SEQ    # 128 rows per rank
MOE_TOKENS = 128                       # rows per MoE call per rank (runner DSPARK_MOE_TOKENS)
PREFILL_REQUESTS_PER_GROUP = 64
PREFILL_TOKENS_PER_GROUP = 8192
PREFILL_LOGIT_ROWS = 128
MAX_PREFILL_TOKENS_PER_REQUEST = 8192
SAMPLED_IDS_PAD = 8

# DSpark
DSPARK_QUERY_WIDTH = 7
SUPPORTED_K = (0, DSPARK_QUERY_WIDTH)
DRAFTER_LEASES_PER_GROUP = 64
DRAFTER_BLOCKS_PER_LEASE = 6           # ceil((31 + 128 + 7) / 32)
DRAFTER_FILLER_BLOCK_BASE = DRAFTER_LEASES_PER_GROUP * DRAFTER_BLOCKS_PER_LEASE   # 384
DRAFTER_POOL_BLOCKS = 512
DRAFTER_BATCHES = (4, 8, 12, 16)
DRAFTER_MAX_BATCH = 16
DRAFTER_CONTEXT_BUCKETS = (32, 64, 96, 128)
DRAFTER_QUERY_ROWS = DRAFTER_MAX_BATCH * DSPARK_QUERY_WIDTH      # 112 per rank
DRAFTER_GROUP_QUERY_ROWS = TP_SIZE * DRAFTER_QUERY_ROWS          # 448 per group
STATE_META_FIELDS = ("valid", "generation", "anchor_position", "committed_count", "draft_count",
                     "position_limit")

# grammar mask
GRAMMAR_SEGMENT_TOKENS = 808
GRAMMAR_SEGMENT_BITS = 1024
GRAMMAR_WORDS_PER_SEGMENT = GRAMMAR_SEGMENT_BITS // 16   # 64 int16 words

# W8A8
INT8_SCALE_MAX = 127.0
INT8_AMAX_EPS = 1e-4

GIB = 1 << 30
