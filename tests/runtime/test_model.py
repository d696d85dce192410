"""The model object load() returns: built whole (cache, hooks, decoder, config in its
constructor), called like the family model, and closing its cache as a context manager."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

import strata_mlx
from strata_mlx.runtime.decode import PipelinedDecoder, SyncDecoder
from strata_mlx.runtime.model import StrataModel
from strata_mlx.stream.stats import RoutingTrace


def test_load_returns_the_model_object_whole_and_it_closes_its_cache(store):
    path = store("qwen3_moe")
    seen = []
    trace = RoutingTrace()

    def dump(layer, x, ids, scores, y):
        seen.append(layer)

    with strata_mlx.load(path, dump=dump, trace=trace, moce_bonus=0.25)[0] as model:
        assert isinstance(model, StrataModel)
        ec = model.expert_cache
        assert (ec.dump, ec.trace, ec.route_bonus) == (dump, trace, 0.25)
        assert model.store_path == path and model.runtime.moce_bonus == 0.25
        assert all(b.switch_mlp.expert_cache is ec for b in model.moe_blocks().values())
        # the family model's surface: called, cached, its modules and parameters
        logits = model(mx.array([[1, 2, 3]]), cache=model.make_cache())
        assert logits.shape == (1, 3, model.args.vocab_size)
        assert len(model.layers) == len(model.model.layers) and model.parameters()
        assert sorted(set(seen)) == sorted(model.moe_blocks())
        # a dump hook needs the per-layer handshake's tensors: decode runs it
        assert isinstance(model.decoder, PipelinedDecoder)
        assert isinstance(model.decoding(), SyncDecoder)
    with pytest.raises(RuntimeError, match="expert cache is closed"):
        model(mx.array([[1]]), cache=model.make_cache())


def test_the_decoder_follows_the_runtime_config(store):
    path = store("qwen3_moe")
    with strata_mlx.load(path, decode="sync")[0] as model:
        assert model.decoding() is model.sync_decoder
    with strata_mlx.load(path)[0] as model:
        assert isinstance(model.decoding(), PipelinedDecoder)


def test_a_policy_of_the_profile_on_a_store_without_one_warns(store, tmp_path):
    """--read-ahead static and --eviction profile rank experts by the store's routing
    profile; on a store converted without one they ranked by id without a word."""
    import shutil
    import warnings

    path = shutil.copytree(store("qwen3_moe"), tmp_path / "s")
    (path / "profile.json").unlink()
    for kw, says in [
        (dict(read_ahead="static"), "--read-ahead static ranks experts by id"),
        (dict(eviction="profile"), "--eviction profile ranks experts by id"),
    ]:
        with pytest.warns(UserWarning, match="no routing profile") as seen:
            model, _ = strata_mlx.load(path, **kw)
        assert says in str(seen[0].message)
        model.expert_cache.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, _ = strata_mlx.load(path, read_ahead="lookahead")  # (none needs it)
    model.expert_cache.close()


@pytest.mark.parametrize(
    "hook, says",
    [
        (dict(trace="run.npz"), "trace='run.npz': a strata_mlx.stream.stats.RoutingTrace"),
        (dict(dump=123), "dump=123: a callable"),
    ],
)
def test_a_research_hook_of_the_wrong_kind_is_refused_at_load(store, hook, says):
    """It loaded, then the first generate failed inside the cache ('str' object has no
    attribute 'record')."""
    from strata_mlx.config import OptionError

    with pytest.raises(OptionError, match=re.escape(says)):
        strata_mlx.load(store("qwen3_moe"), **hook)
