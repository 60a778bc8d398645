"""The step items' hand-written constructors and the block-table view against their dataclass fields."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

from twin.abi.batches import BlockTables, DecodeItem, PrefillItem


@pytest.mark.parametrize("cls", [PrefillItem, DecodeItem])
def test_constructor_takes_the_dataclass_fields_in_order_with_their_defaults(cls):
    fields = dataclasses.fields(cls)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        want = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert p.default == want, f.name


def _decode(**kw):
    args = dict(request_id="r1", last_token=5, anchor=100, block_ids={"ori": (1, 2)}, partition=2)
    return DecodeItem(**{**args, **kw})


def test_items_stay_frozen_values():
    a = _decode(lease=3, generation=1)
    assert a == _decode(lease=3, generation=1) and a != _decode(lease=4, generation=1)
    assert (a.pending_drafts, _decode().lease, _decode().generation) == ((), None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.anchor = 7
    b = dataclasses.replace(a, last_token=9)
    assert (b.last_token, b.anchor, a.last_token) == (9, 100, 5)
    p = PrefillItem("r2", (1, 2, 3), 4, 7, {}, 1)
    assert (p.num_tokens, p.end, p.terminal, p.lease) == (3, 7, True, None)
    assert "chunk_tokens=(1, 2, 3)" in repr(p)


def test_block_tables_read_as_the_dict_of_families():
    tables = ((4, 5), (), (None, 7))
    view = BlockTables({"ori": 0, "cmp_c4": 1, "swa": 2}, tables)
    want = {"ori": (4, 5), "cmp_c4": (), "swa": (None, 7)}
    assert view == want and dict(view) == want and list(view) == list(want)
    assert len(view) == 3 and "swa" in view and "idx" not in view and view.get("idx") is None
    assert view["swa"] is tables[2]           # the page manager's tuple, not a copy
    with pytest.raises(KeyError):
        view["idx"]
    assert view != {"ori": (4, 5)}
    assert repr(view) == repr(want)
