"""docs/abi.md is generated from the description and must not go stale."""
from twin.abi import docgen


def test_abi_reference_is_current():
    committed = docgen.DOC_PATH.read_text()
    assert committed == docgen.render(), "docs/abi.md is stale: run `python -m twin.abi.docgen --write`"


def test_abi_reference_mentions_every_program_and_family():
    text = docgen.render()
    for name in ("l3_prefill_fwd", "l3_decode_fwd_dspark", "l3_distributed_markov_sample", "csa_inner_state"):
        assert f"`{name}`" in text
    assert "### `l3_decode_fwd_dspark` (151 args)" in text


def test_capacity_account_block_is_current():
    text = docgen.CAPACITY_PATH.read_text()
    assert docgen.ACCOUNT_BEGIN in text and docgen.ACCOUNT_END in text
    assert text == docgen.render_capacity(text), "docs/capacity.md is stale: run `python -m twin.abi.docgen --write`"
