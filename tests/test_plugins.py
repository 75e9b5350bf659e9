"""The plugin registry (runtime/plugins.py): registration, resolution, topology checks.

Contract: DESIGN §3 and issue 2 point 4. Resolution order: a name given to
``register_plugin``, then the ``phyrt.plugins`` entry points, then a
``"package.module:Class"`` string that must resolve the same way in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import runtime
from runtime.core import plugins
from runtime.core.config import (
    AttentionParallelConfig,
    DenseParallelConfig,
    MoeParallelConfig,
    OuterParallelConfig,
    ParallelConfig,
)
from runtime.core.plugins import BuildContext, Entry, known_plugins, register_plugin, resolve_plugin
from tests.fixtures_plugins import thirdparty
from tests.fixtures_plugins.thirdparty import DoubleEntry, NotAnEntry, Outer, SingleRankEntry

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
MODULE = "tests.fixtures_plugins.thirdparty"
DOUBLE_SPEC = f"{MODULE}:DoubleEntry"


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
    """Each test sees the registry as it was and cannot leak names into the next."""
    monkeypatch.setattr(plugins, "_registry", dict(plugins._registry))


def _entry(name: str = "local", domains=frozenset()) -> type[Entry]:
    return type(f"Local_{name.replace('-', '_')}", (Entry,), {"name": name, "parallel_domains": domains})


# --------------------------------------------------------------------------- register_plugin


def test_public_api_names_are_the_registry_ones():
    assert runtime.Entry is Entry
    assert runtime.register_plugin is register_plugin
    assert runtime.BuildContext is BuildContext


def test_register_as_a_function_returns_the_class_and_resolves():
    assert register_plugin("fx-fn", DoubleEntry) is DoubleEntry
    assert resolve_plugin("fx-fn") is DoubleEntry
    assert "fx-fn" in known_plugins()


def test_register_as_a_decorator_leaves_the_class_usable():
    @register_plugin("fx-decorated")
    class Decorated(Entry):
        name = "fx-decorated"

        def build(self, ctx, plugin_args):
            return plugin_args

    assert isinstance(Decorated, type) and issubclass(Decorated, Entry)
    assert Decorated.__name__ == "Decorated"
    assert resolve_plugin("fx-decorated") is Decorated
    assert Decorated().build(None, "args") == "args"


def test_registering_the_same_class_again_is_fine():
    register_plugin("fx-twice", DoubleEntry)
    assert register_plugin("fx-twice", DoubleEntry) is DoubleEntry
    assert register_plugin("fx-twice")(DoubleEntry) is DoubleEntry
    assert resolve_plugin("fx-twice") is DoubleEntry
    assert known_plugins().count("fx-twice") == 1


def test_another_class_under_a_taken_name_raises_and_keeps_the_first():
    register_plugin("fx-taken", DoubleEntry)
    with pytest.raises(ValueError, match=rf"'fx-taken' is already registered to {DOUBLE_SPEC}"):
        register_plugin("fx-taken", SingleRankEntry)
    with pytest.raises(ValueError, match="already registered"):
        @register_plugin("fx-taken")
        class Other(Entry):
            pass
    assert resolve_plugin("fx-taken") is DoubleEntry


def test_one_class_may_have_several_names():
    register_plugin("fx-a", DoubleEntry)
    register_plugin("fx-b", DoubleEntry)
    assert resolve_plugin("fx-a") is resolve_plugin("fx-b") is DoubleEntry


@pytest.mark.parametrize("target", [int, NotAnEntry, DoubleEntry(), thirdparty.not_a_class, "tests:X", None],
                         ids=["int", "plain-class", "instance", "function", "string", "none-via-decorator"])
def test_non_entry_targets_are_rejected(target):
    with pytest.raises(TypeError, match=r"register_plugin\('fx-bad'\) needs an Entry subclass"):
        if target is None:
            register_plugin("fx-bad")(target)
        else:
            register_plugin("fx-bad", target)
    with pytest.raises(ValueError, match="unknown plugin 'fx-bad'"):
        resolve_plugin("fx-bad")


@pytest.mark.parametrize("name", ["", "pkg.mod:Entry", ":x"])
def test_bad_plugin_names_are_rejected(name):
    with pytest.raises(ValueError, match=r"plugin name must be a non-empty string without ':'"):
        register_plugin(name, DoubleEntry)


def test_bad_plugin_name_type_is_rejected():
    with pytest.raises((TypeError, ValueError), match="plugin name"):
        register_plugin(5, DoubleEntry)


def test_concurrent_registration_of_one_name_has_exactly_one_winner():
    classes = [_entry(f"racer{i}") for i in range(16)]
    barrier = threading.Barrier(len(classes))
    results: list[object] = [None] * len(classes)

    def race(i: int) -> None:
        barrier.wait(10)
        try:
            results[i] = register_plugin("fx-race", classes[i])
        except ValueError as exc:
            results[i] = exc

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(classes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    winners = [r for r in results if isinstance(r, type)]
    assert len(winners) == 1
    assert all(isinstance(r, ValueError) for r in results if r is not winners[0])
    assert resolve_plugin("fx-race") is winners[0]


# --------------------------------------------------------------------------- resolution


def test_registered_name_wins_over_an_entry_point_of_the_same_name():
    register_plugin("policy", DoubleEntry)
    assert resolve_plugin("policy") is DoubleEntry


def test_builtin_policy_is_found_through_the_entry_point():
    # declared in pyproject.toml: [project.entry-points."phyrt.plugins"] policy = ...
    assert "policy" in known_plugins()
    cls = resolve_plugin("policy")
    assert issubclass(cls, Entry)
    assert cls.spec() == "models.policy:PolicyEntry"
    assert resolve_plugin(cls.spec()) is cls


def test_spec_string_resolves_to_the_class_and_round_trips():
    cls = resolve_plugin(DOUBLE_SPEC)
    assert cls is DoubleEntry
    assert DoubleEntry.spec() == DOUBLE_SPEC
    assert resolve_plugin(cls.spec()) is cls
    assert cls().build(None, None).execute(21) == 42


def test_a_class_defined_in_a_function_resolves_by_name_but_its_spec_fails_clearly():
    @register_plugin("fx-local")
    class Local(Entry):
        pass

    assert resolve_plugin("fx-local") is Local
    # no interpreter can import a function's local class: the error must say which spec
    with pytest.raises((ValueError, ImportError)) as info:
        resolve_plugin(Local.spec())
    assert Local.spec() in str(info.value)


def test_spec_of_a_nested_class_round_trips():
    spec = Outer.NestedEntry.spec()
    assert spec == f"{MODULE}:Outer.NestedEntry"
    assert resolve_plugin(spec) is Outer.NestedEntry


def test_spec_string_resolves_in_a_fresh_interpreter():
    code = textwrap.dedent(f"""
        import sys
        from runtime.core.plugins import Entry, resolve_plugin
        assert "{MODULE}" not in sys.modules
        cls = resolve_plugin("{DOUBLE_SPEC}")
        assert issubclass(cls, Entry)
        print(cls.spec())
        print(cls().build(None, None).execute(21))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [DOUBLE_SPEC, "42"]


def test_builtin_entry_point_resolves_in_a_fresh_interpreter_without_importing_models_first():
    code = textwrap.dedent("""
        import sys
        from runtime.core.plugins import known_plugins, resolve_plugin
        assert "policy" in known_plugins()
        assert not any(m == "models" or m.startswith("models.") for m in sys.modules)
        print(resolve_plugin("policy").spec())
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["models.policy:PolicyEntry"]


def test_a_name_registered_here_is_unknown_in_a_fresh_interpreter_but_its_spec_is_not():
    # Why the engine hands ranks spec() and not the registered name.
    register_plugin("fx-only-here", DoubleEntry)
    code = textwrap.dedent(f"""
        from runtime.core.plugins import resolve_plugin
        try:
            resolve_plugin("fx-only-here")
        except ValueError as exc:
            print("unknown" if "unknown plugin 'fx-only-here'" in str(exc) else exc)
        print(resolve_plugin({resolve_plugin("fx-only-here").spec()!r}).__name__)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["unknown", "DoubleEntry"]


def test_unknown_name_lists_the_known_plugins():
    register_plugin("fx-listed", DoubleEntry)
    with pytest.raises(ValueError) as info:
        resolve_plugin("no-such-plugin")
    message = str(info.value)
    assert "unknown plugin 'no-such-plugin'" in message
    assert "known plugins:" in message
    for name in known_plugins():
        assert name in message
    assert "fx-listed" in message and "policy" in message
    assert "package.module:EntryClass" in message


def test_known_plugins_is_sorted_and_holds_registered_and_entry_point_names():
    register_plugin("zz-fx", DoubleEntry)
    register_plugin("aa-fx", DoubleEntry)
    names = known_plugins()
    assert names == sorted(names)
    assert {"aa-fx", "zz-fx", "policy"} <= set(names)


@pytest.mark.parametrize("spec", [
    f"{MODULE}:", ":DoubleEntry", f"{MODULE}:DoubleEntry:extra", "tests fixtures:DoubleEntry",
    f"{MODULE}:1Double", "1mod:DoubleEntry", "tests/fixtures_plugins/thirdparty.py:DoubleEntry",
    f"{MODULE}:Double-Entry", "-mod:X",
])
def test_malformed_spec_strings_raise_value_error(spec):
    with pytest.raises(ValueError, match=r"plugin spec must look like 'package\.module:EntryClass'"):
        resolve_plugin(spec)


@pytest.mark.parametrize("spec,module", [
    (f"{MODULE.rsplit('.', 1)[0]}.nope:DoubleEntry", "tests.fixtures_plugins.nope"),
    ("phyrt_no_such_package.mod:Entry", "phyrt_no_such_package.mod"),
])
def test_missing_module_raises_import_error_naming_it(spec, module):
    with pytest.raises(ImportError, match=rf"cannot import module '{module}'"):
        resolve_plugin(spec)


def test_module_with_a_missing_dependency_names_the_dependency():
    with pytest.raises(ImportError, match=r"tests\.fixtures_plugins\.import_fails.*"
                                          r"phyrt_fixture_dependency_that_does_not_exist"):
        resolve_plugin("tests.fixtures_plugins.import_fails:Anything")


def test_missing_attribute_raises_import_error_naming_it():
    with pytest.raises(ImportError, match=rf"module '{MODULE}' has no attribute 'Missing'"):
        resolve_plugin(f"{MODULE}:Missing")


@pytest.mark.parametrize("attr", ["NotAnEntry", "not_a_class", "NOT_A_CLASS", "Outer"])
def test_spec_pointing_at_a_non_entry_raises_type_error(attr):
    with pytest.raises(TypeError, match=rf"plugin '{MODULE}:{attr}' resolved to .* not an Entry subclass"):
        resolve_plugin(f"{MODULE}:{attr}")


@pytest.mark.parametrize("name", [None, "", 5, DoubleEntry])
def test_resolve_needs_a_non_empty_string(name):
    with pytest.raises(TypeError, match="plugin must be a non-empty string"):
        resolve_plugin(name)


# --------------------------------------------------------------------------- Entry.validate_parallel


def dense(tp=1, dp=None):
    return ParallelConfig(dense=DenseParallelConfig(tp_size=tp, dp_size=dp))


REJECTED_BY_SINGLE_RANK = [
    pytest.param(dense(tp=2), "dense.tp_size=2", id="dense-tp2"),
    pytest.param(ParallelConfig(outer=OuterParallelConfig(cfg_size=2)), "outer.cfg_size=2", id="cfg2"),
    pytest.param(ParallelConfig(outer=OuterParallelConfig(pipeline_size=2)), "outer.pipeline_size=2",
                 id="pipeline2"),
    pytest.param(dense(tp=1, dp=2), "a partition of 2 ranks", id="dense-dp2"),
    pytest.param(ParallelConfig(attention=AttentionParallelConfig(cp_size=2)), "attention.cp_size=2", id="cp2"),
    pytest.param(ParallelConfig(moe=MoeParallelConfig(ep_size=4)), "moe.ep_size=4", id="ep4"),
]


def test_single_rank_plugin_accepts_the_default_layout():
    assert SingleRankEntry().validate_parallel(ParallelConfig()) is None
    assert Entry().validate_parallel(ParallelConfig()) is None


@pytest.mark.parametrize("parallel,offender", REJECTED_BY_SINGLE_RANK)
def test_single_rank_plugin_rejects_every_split_naming_the_size(parallel, offender):
    with pytest.raises(ValueError) as info:
        SingleRankEntry().validate_parallel(parallel)
    message = str(info.value)
    assert offender in message
    assert "'fixture-single'" in message
    assert "single rank only" in message


def test_rejection_lists_every_offending_size():
    parallel = ParallelConfig(outer=OuterParallelConfig(pipeline_size=3, cfg_size=2),
                              dense=DenseParallelConfig(tp_size=4))
    with pytest.raises(ValueError) as info:
        SingleRankEntry().validate_parallel(parallel)
    for offender in ("outer.pipeline_size=3", "outer.cfg_size=2", "dense.tp_size=4", "a partition of 4 ranks"):
        assert offender in str(info.value)


def test_dense_plugin_accepts_dense_splits_with_the_other_domains_filling():
    parallel = dense(tp=2)
    assert (parallel.attention.dp_size, parallel.moe.dp_size) == (2, 2)
    assert DoubleEntry().validate_parallel(parallel) is None
    assert DoubleEntry().validate_parallel(dense(tp=2, dp=2)) is None
    assert DoubleEntry().validate_parallel(dense(tp=1, dp=2)) is None
    assert DoubleEntry().validate_parallel(ParallelConfig()) is None


@pytest.mark.parametrize("parallel,offender", [
    pytest.param(ParallelConfig(attention=AttentionParallelConfig(tp_size=2)), "attention.tp_size=2", id="attn-tp2"),
    pytest.param(ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2)),
                 "attention.tp_size=2", id="dense-and-attn-tp2"),
    pytest.param(ParallelConfig(attention=AttentionParallelConfig(cp_size=2)), "attention.cp_size=2", id="attn-cp2"),
    pytest.param(ParallelConfig(moe=MoeParallelConfig(ep_size=2)), "moe.ep_size=2", id="moe-ep2"),
    pytest.param(ParallelConfig(dense=DenseParallelConfig(tp_size=2), moe=MoeParallelConfig(tp_size=2)),
                 "moe.tp_size=2", id="moe-tp2"),
    pytest.param(ParallelConfig(outer=OuterParallelConfig(cfg_size=2), dense=DenseParallelConfig(tp_size=2)),
                 "outer.cfg_size=2", id="cfg2"),
])
def test_dense_plugin_rejects_undeclared_domains(parallel, offender):
    with pytest.raises(ValueError) as info:
        DoubleEntry().validate_parallel(parallel)
    message = str(info.value)
    assert offender in message
    assert "parallel_domains=['dense']" in message
    assert "dense.tp_size" not in message  # the declared domain is never blamed


@pytest.mark.parametrize("domains,parallel", [
    ({"cfg"}, ParallelConfig(outer=OuterParallelConfig(cfg_size=2))),
    ({"pipeline"}, ParallelConfig(outer=OuterParallelConfig(pipeline_size=4))),
    ({"attention"}, ParallelConfig(attention=AttentionParallelConfig(tp_size=2, cp_size=2))),
    ({"moe"}, ParallelConfig(moe=MoeParallelConfig(tp_size=2, ep_size=4))),
    ({"dense", "attention", "cfg"}, ParallelConfig(outer=OuterParallelConfig(cfg_size=2),
                                                  dense=DenseParallelConfig(tp_size=2),
                                                  attention=AttentionParallelConfig(tp_size=2))),
    ({"dense", "attention", "moe", "cfg"}, ParallelConfig(outer=OuterParallelConfig(cfg_size=2),
                                                         dense=DenseParallelConfig(tp_size=4),
                                                         attention=AttentionParallelConfig(tp_size=4),
                                                         moe=MoeParallelConfig(tp_size=2, ep_size=2))),
])
def test_declared_domains_are_accepted(domains, parallel):
    assert _entry("declares", frozenset(domains))().validate_parallel(parallel) is None
    # tuple and set declarations work the same
    assert _entry("declares", tuple(sorted(domains)))().validate_parallel(parallel) is None
    assert _entry("declares", set(domains))().validate_parallel(parallel) is None


def test_spec_topology_without_moe_declared_names_both_moe_sizes():
    parallel = ParallelConfig(outer=OuterParallelConfig(cfg_size=2), dense=DenseParallelConfig(tp_size=4),
                              attention=AttentionParallelConfig(tp_size=4), moe=MoeParallelConfig(tp_size=2, ep_size=2))
    with pytest.raises(ValueError) as info:
        _entry("cosmos-like", frozenset({"dense", "attention", "cfg"}))().validate_parallel(parallel)
    assert "moe.tp_size=2" in str(info.value) and "moe.ep_size=2" in str(info.value)


@pytest.mark.parametrize("domains", [{"dense", "tensor"}, {"tp"}, {"Dense"}])
def test_unknown_declared_domain_is_rejected(domains):
    with pytest.raises(ValueError) as info:
        _entry("typo", frozenset(domains))().validate_parallel(ParallelConfig())
    message = str(info.value)
    assert "unknown parallel domains" in message
    for bad in domains - plugins.KNOWN_DOMAINS:
        assert repr(bad) in message
    for known in ("attention", "cfg", "dense", "moe", "pipeline"):
        assert known in message


def test_a_subclass_may_tighten_validate_parallel():
    class EvenTpOnly(Entry):
        parallel_domains = frozenset({"dense"})

        def validate_parallel(self, parallel):
            super().validate_parallel(parallel)
            if parallel.dense.tp_size > 2:
                raise ValueError(f"at most tp 2, got {parallel.dense.tp_size}")

    EvenTpOnly().validate_parallel(dense(tp=2))
    with pytest.raises(ValueError, match="at most tp 2, got 4"):
        EvenTpOnly().validate_parallel(dense(tp=4))
    with pytest.raises(ValueError, match="moe.ep_size=2"):
        EvenTpOnly().validate_parallel(ParallelConfig(moe=MoeParallelConfig(ep_size=2)))


# --------------------------------------------------------------------------- the rest of Entry


def _ctx(rank: int = 0) -> BuildContext:
    return BuildContext(rank=rank, world_size=2, replica_index=0, device="cpu", target="cpu",
                        params_dtype="float32", parallel=dense(tp=2))


def test_default_build_raises_not_implemented_naming_the_plugin():
    bare = _entry("bare-plugin")
    with pytest.raises(NotImplementedError, match="'bare-plugin' does not implement build"):
        bare().build(_ctx(), None)
    with pytest.raises(NotImplementedError, match="'Entry' does not implement build"):
        Entry().build(_ctx(), None)


def test_default_request_and_argument_hooks_accept_anything():
    entry = SingleRankEntry()
    for payload in (None, {"obs": [1.0]}, 3, b"raw"):
        assert entry.validate_request(payload) is None
        assert entry.configure(payload) is None


def test_default_entry_declares_no_domains():
    assert set(Entry.parallel_domains) == set()
    assert set(SingleRankEntry.parallel_domains) == set()


def test_build_context_is_frozen_and_rank_zero_is_the_output_rank():
    import dataclasses

    ctx = _ctx(rank=0)
    assert ctx.is_output_rank
    assert not _ctx(rank=1).is_output_rank
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.rank = 1
