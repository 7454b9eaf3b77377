"""The plugin manager, registries and CLI with kiln-core alone (other installed plugins are ignored)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
from kiln_core_tiny import tiny_qwen3_bundle

import kiln.core
from kiln.core import OpDef, OpRegistry, PluginSession, TensorType
from kiln.core._errors import KilnError, KilnWarning, PluginError
from kiln.core.cli._cli import main
from kiln.core.plugins._hookspecs import hookimpl
from kiln.core.plugins._registry import KINDS, NamedRegistry, PluginInfo, RegistryKind, declare_kind
from kiln.core.plugins._session import (
    failed_plugins,
    get_registry,
    list_plugins,
    plugin_session,
    register_plugin,
    reset_plugins,
)
from kiln.core.recompute import plan_context, plan_recompute

AUTOLOAD = "KILN_DISABLE_PLUGIN_AUTOLOAD"
CORE_VERSION = importlib.metadata.version("kiln-core")


@pytest.fixture(autouse=True)
def core_only(monkeypatch: pytest.MonkeyPatch, fresh_plugins: PluginSession) -> None:
    # A session loads its plugins on first use, so the environment set here (and by fake_dist) counts.
    monkeypatch.setenv(AUTOLOAD, "1")
    monkeypatch.delenv("KILN_DEBUG", raising=False)


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make a distribution with a ``kiln`` entry point in tmp_path; autoload sees only those."""

    def make(dist: str, source: str, *, version: str = "0.3.0") -> None:
        module = dist.replace("-", "_")
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[kiln]\n{module} = {module}\n")

    def entry_points(group: str) -> importlib.metadata.EntryPoints:
        dists = importlib.metadata.distributions(path=[str(tmp_path)])
        return importlib.metadata.EntryPoints(ep for d in dists for ep in d.entry_points if ep.group == group)

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.delenv(AUTOLOAD)
    return make


def _plugin(**hooks: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


def _backends(*names: str) -> types.SimpleNamespace:
    def kiln_register_backends(registry: NamedRegistry[Any]) -> None:
        for name in names:
            registry.register(name, object())

    return _plugin(kiln_register_backends=kiln_register_backends)


def _same(ctx: Any) -> list[TensorType]:
    return [TensorType(ctx.shape(0), ctx.dtype(0))]


def _names(infos: list[PluginInfo]) -> list[str]:
    return [p.name for p in infos]


# --- registries -------------------------------------------------------------------------------------


def test_registry_basics_and_unknown_names() -> None:
    reg: NamedRegistry[int] = NamedRegistry("backends", providers={"cuda": "kiln-kernels-cuda"})
    reg.register("numpy", 1)
    reg.register("alpha", 2, plugin="mine")
    assert reg["numpy"] == 1 and "alpha" in reg and "cuda" not in reg and len(reg) == 2
    assert list(reg) == reg.names() == ["numpy", "alpha"]
    assert reg.items() == [("numpy", 1), ("alpha", 2)]
    assert reg.owner("numpy") == "<runtime>" and reg.owner("alpha") == "mine"
    with pytest.raises(KilnError, match=r"'cuda' in the backends registry; registered: alpha, numpy") as err:
        reg["cuda"]
    assert err.value.hint is not None and "pip install kiln-kernels-cuda" in err.value.hint
    with pytest.raises(KilnError, match="registered: alpha, numpy"):
        reg.owner("nope")


def test_duplicate_names_both_plugins() -> None:
    reg: NamedRegistry[int] = NamedRegistry("graph_passes")
    reg.register("p", 1, plugin="first")
    with pytest.raises(
        PluginError, match=r"'p' is registered twice .* by plugin 'first' .* by plugin 'second'"
    ):
        reg.register("p", 2, plugin="second")
    assert reg["p"] == 1


def test_remove_owner_takes_out_every_entry_of_one_plugin() -> None:
    mine, other = PluginInfo("mine", "kiln-mine", "1.0", "m"), PluginInfo("other", None, None, "o")
    reg: NamedRegistry[int] = NamedRegistry("graph_passes")
    reg.register("a", 1, plugin=mine)  # type: ignore[arg-type]
    reg.register("b", 2, plugin=other)  # type: ignore[arg-type]
    reg.register("c", 3, plugin=mine)  # type: ignore[arg-type]
    assert reg.remove_owner(mine) == ["a", "c"] and reg.names() == ["b"]
    assert reg.remove_owner(mine) == []


def test_get_registry_caches_and_rejects_unknown_kinds() -> None:
    assert get_registry("graph_passes") is get_registry("graph_passes")
    with pytest.raises(KilnError, match="unknown registry kind 'nope'; known: adapters, backends"):
        get_registry("nope")


def test_kinds_are_declared_by_their_layer_and_built_by_any_session(monkeypatch: pytest.MonkeyPatch) -> None:
    assert KINDS["ops"].registry_cls is OpRegistry and KINDS["ops"].hook == "kiln_register_ops"
    session = PluginSession(autoload=False)
    session.plugins()  # loaded before the kind exists
    monkeypatch.setitem(KINDS, "late", KINDS["adapters"])  # restored after the test
    declare_kind("late", "kiln_register_adapters", OpRegistry)
    assert isinstance(session.registry("late"), OpRegistry)
    with pytest.raises(KilnError, match="already declared with hook 'kiln_register_adapters'"):
        declare_kind("late", "kiln_register_backends")
    monkeypatch.setitem(KINDS, "planner", RegistryKind("planner", "kiln_plan_recompute", NamedRegistry))
    with pytest.raises(KilnError, match="'kiln_plan_recompute', which is not a historic kiln hook"):
        session.registry("planner")


def test_contribution_hooks_are_historic_and_fill_the_declared_kinds() -> None:
    from kiln.core.plugins import _hookspecs

    specs = {name: fn.kiln_spec for name, fn in vars(_hookspecs).items() if hasattr(fn, "kiln_spec")}
    historic = {name for name, opts in specs.items() if opts["historic"]}
    assert historic == {name for name in specs if name.startswith("kiln_register_")}
    assert {kind.hook for kind in KINDS.values()} <= historic
    assert {"ops", "backends", "graph_passes", "weight_formats", "adapters", "communicators"} <= set(KINDS)


# --- sessions ---------------------------------------------------------------------------------------


def test_two_sessions_do_not_share_state() -> None:
    one, two = PluginSession(autoload=False), PluginSession(autoload=False)
    one.register(_backends("only-one"), "p1")
    with pytest.warns(KilnWarning, match="'p2'"):
        two.register(_plugin(kiln_register_adapters=lambda registry: 1 / 0), "p2")
        two.registry("adapters")
    assert "only-one" in one.registry("backends") and "only-one" not in two.registry("backends")
    assert one.registry("ops") is not two.registry("ops") and one.registry("ops") is not get_registry("ops")
    assert _names(one.plugins()) == ["core", "p1"] and _names(two.plugins()) == ["core"]
    assert one.failed() == [] and _names(two.failed()) == ["p2"]
    assert one.manager is not two.manager and list_plugins() == [one.plugins()[0]]
    current = plugin_session()
    reset_plugins()
    assert plugin_session() is not current


def test_registries_are_reachable_while_being_built() -> None:
    seen: list[Any] = []

    def kiln_register_ops(registry: OpRegistry) -> None:
        registry.register_op(OpDef("probe", ("x",), ("y",), lambda x: 2 * x, _same))
        seen.append(kiln.core.op_registry() is registry)
        kiln.core.register_backward_rule("probe", lambda ctx: [ctx.emit("scale", ctx.d_out, factor=2.0)])
        kiln.core.register_backward_rule("matmul", seen.append, replace=True)  # core's op, already there

    session = PluginSession(autoload=False)
    session.register(_plugin(kiln_register_ops=kiln_register_ops), "rules")
    ops = session.registry("ops")  # not the current session: the hook still gets this one
    assert seen == [True] and ops["probe"].backward is not None and ops["matmul"].backward == seen.append
    assert ops.owner("probe").name == "rules" and session.failed() == []  # type: ignore[union-attr]
    assert get_registry("ops")["matmul"].backward != seen.append


def test_contribution_hooks_run_in_registration_order_core_first() -> None:
    calls: list[str] = []

    def plugin(name: str) -> types.SimpleNamespace:
        return _plugin(kiln_register_backends=lambda registry: calls.append(name))

    for name in ("b", "a", "c"):
        register_plugin(plugin(name), name)
    backends = get_registry("backends")
    assert calls == ["b", "a", "c"] and backends.names() == ["numpy"]  # core's ran first


# --- run-time plugins and historic hooks ------------------------------------------------------------


def test_register_plugin_at_run_time_gets_the_historic_calls() -> None:
    before = get_registry("backends")  # built before the plugin arrives
    ops = get_registry("ops")

    def kiln_register_ops(registry: OpRegistry) -> None:
        registry.register_op(OpDef("late_op", ("x",), ("y",), lambda x: x, _same))

    plugin = _backends("toy")
    plugin.kiln_register_ops = hookimpl(kiln_register_ops)
    info = register_plugin(plugin, "toy-plugin")
    assert info == PluginInfo("toy-plugin", None, None, "types")
    assert _names(list_plugins()) == ["core", "toy-plugin"]
    assert "toy" in before and before.owner("toy") == info and ops.owner("late_op") == info
    with pytest.raises(PluginError, match="toy-plugin"):
        register_plugin(_backends(), "toy-plugin")  # the name is taken
    with pytest.raises(PluginError, match="already registered under another name"):
        register_plugin(plugin, "toy-again")


def test_a_failing_run_time_registration_raises_and_leaves_nothing() -> None:
    backends = get_registry("backends")

    def kiln_register_backends(registry: NamedRegistry[Any]) -> None:
        registry.register("half", object())
        registry.register("numpy", object())  # core's

    with pytest.raises(PluginError, match=r"'greedy' \(registered at run time\): error in kiln_register_"
                                          r"backends: 'numpy' is registered twice") as err:
        register_plugin(_plugin(kiln_register_backends=kiln_register_backends), "greedy")
    assert err.value.plugin == "greedy"
    assert backends.names() == ["numpy"] and backends.owner("numpy").name == "core"  # type: ignore[union-attr]
    assert _names(list_plugins()) == ["core"] and failed_plugins() == []
    register_plugin(_backends("fine"), "greedy")  # the name is free again


def test_run_time_register_op_clash_raises_to_the_caller() -> None:
    with pytest.raises(PluginError, match=r"'matmul' is registered twice in the ops registry: by plugin "
                                          r"'core' \(kiln-core .*\) and by plugin '<runtime>'"):
        kiln.core.register_op(OpDef("matmul", ("x",), ("y",), lambda x: x, _same))


def test_entries_are_attributed_to_their_plugin() -> None:
    a = register_plugin(_backends("a1", "a2"), "plug-a")
    b = register_plugin(_backends("b1"), "plug-b")
    reg = get_registry("backends")
    owners = {n: reg.owner(n) for n in reg}
    assert owners.pop("numpy").name == "core"  # type: ignore[union-attr]
    assert owners == {"a1": a, "a2": a, "b1": b}


# --- failing plugins are skipped --------------------------------------------------------------------


def test_a_duplicate_name_stays_with_the_first_plugin() -> None:
    a = register_plugin(_backends("a1", "shared"), "plug-a")
    register_plugin(_backends("c1", "shared", "c2"), "plug-c")
    with pytest.warns(KilnWarning, match=r"plugin 'plug-c' \(registered at run time\): error in "
                      r"kiln_register_backends: 'shared' is registered twice in the backends registry: "
                      r"by plugin 'plug-a' \(registered at run time\) and by plugin 'plug-c'"):
        reg = get_registry("backends")
    assert reg.names() == ["numpy", "a1", "shared"] and reg.owner("shared") == a  # c1 is gone too
    assert _names(list_plugins()) == ["core", "plug-a"]
    (failed,) = failed_plugins()
    assert failed.name == "plug-c" and failed.status.startswith("failed: error in kiln_register_backends: ")


def test_a_plugin_that_raises_is_dropped_with_all_its_entries() -> None:
    def kiln_register_adapters(registry: NamedRegistry[Any]) -> None:
        registry.register("half_adapter", object())
        raise ValueError("boom")

    plugin = _backends("half_backend")
    plugin.kiln_register_adapters = hookimpl(kiln_register_adapters)
    plugin.kiln_plan_recompute = hookimpl(lambda mode: None)
    register_plugin(plugin, "exploding")
    register_plugin(_backends("bystander"), "bystander")
    backends = get_registry("backends")
    assert "half_backend" in backends
    with pytest.warns(KilnWarning, match=r"'exploding' .*: error in kiln_register_adapters: ValueError: bo"):
        adapters = get_registry("adapters")
    assert "half_adapter" not in adapters and "half_backend" not in backends and "bystander" in backends
    assert _names(list_plugins()) == ["core", "bystander"]
    assert failed_plugins()[0].error == "error in kiln_register_adapters: ValueError: boom"
    assert not any(impl.plugin_name == "exploding"
                   for impl in kiln.core.plugin_manager().hook.kiln_plan_recompute.get_hookimpls())
    assert "exploding" not in get_registry("communicators").names()  # later registries: not called


def test_a_plugins_own_kiln_error_is_reported_by_its_message() -> None:
    def kiln_register_communicators(registry: NamedRegistry[Any]) -> None:
        raise KilnError("needs MPI", hint="install mpi4py")

    register_plugin(_plugin(kiln_register_communicators=kiln_register_communicators), "strict")
    with pytest.warns(KilnWarning, match=r"'strict' \(registered at run time\): error in kiln_register_"
                                         r"communicators: needs MPI. kiln goes on without it$"):
        assert get_registry("communicators").names() == []


def test_a_failing_planner_is_skipped_and_core_plans() -> None:
    def kiln_plan_recompute(mode: str) -> None:
        raise RuntimeError("planner crashed")

    register_plugin(_plugin(kiln_plan_recompute=kiln_plan_recompute), "crashing-planner")
    context = plan_context(tiny_qwen3_bundle(), bindings={"B": 2, "T": 6})
    with pytest.warns(KilnWarning, match=r"'crashing-planner' .*kiln_plan_recompute: RuntimeError"):
        plan = plan_recompute(context, "block")
    assert plan.planner == "kiln.core" and _names(failed_plugins()) == ["crashing-planner"]


# --- hook wrappers ----------------------------------------------------------------------------------


class _PlanWrapper:
    def __init__(self, replace: object = None) -> None:
        self.seen: list[str] = []
        self.replace = replace

    @hookimpl(wrapper=True)
    def kiln_plan_recompute(self, mode: str) -> Any:
        self.seen.append(mode)
        result = yield
        return self.replace if self.replace is not None else result


def test_a_wrapper_on_kiln_plan_recompute_runs() -> None:
    wrapper = _PlanWrapper()
    register_plugin(wrapper, "plan-wrapper")
    register_plugin(_plugin(kiln_plan_recompute=lambda mode: None), "deferring")
    context = plan_context(tiny_qwen3_bundle(), bindings={"B": 2, "T": 6})
    assert plan_recompute(context, "dsl").planner == "kiln.core" and wrapper.seen == ["dsl"]
    reset_plugins()
    register_plugin(_PlanWrapper(replace="nonsense"), "bad-wrapper")
    with pytest.raises(PluginError, match="a kiln_plan_recompute hook wrapper returned str"):
        plan_recompute(context, "dsl")


def test_a_wrapper_on_kiln_cli_commands_runs(capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[str] = []

    class Wrapper:
        @hookimpl(wrapper=True)
        def kiln_cli_commands(self, register: Any) -> Any:
            calls.append("before")
            yield
            register("wrapped", help="added by a wrapper", run=lambda args: calls.append("ran"))
            calls.append("after")

    register_plugin(Wrapper(), "cli-wrapper")
    assert main(["wrapped"]) == 0
    assert calls == ["before", "after", "ran"]


# --- entry-point loading ------------------------------------------------------------------------------


def test_entry_points_load_unless_autoload_is_disabled(
    fake_dist: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_dist("kiln-demo-ok", "")
    core, demo = list_plugins()
    assert core == PluginInfo("core", "kiln-core", CORE_VERSION, "kiln.core")
    assert demo == PluginInfo("kiln_demo_ok", "kiln-demo-ok", "0.3.0", "kiln_demo_ok")
    monkeypatch.setenv(AUTOLOAD, "1")
    reset_plugins()
    assert _names(list_plugins()) == ["core"]


def test_duplicate_across_distributions_keeps_the_first(fake_dist: Any) -> None:
    src = """
        import pluggy
        @pluggy.HookimplMarker("kiln")
        def kiln_register_backends(registry):
            registry.register("shared", object())
    """
    fake_dist("kiln-demo-dup-a", src, version="1.0")
    fake_dist("kiln-demo-dup-b", src, version="2.0")
    with pytest.warns(KilnWarning) as caught:
        backends = get_registry("backends")
    (warning,) = caught
    text = str(warning.message)
    assert "plugin 'kiln_demo_dup_b' (kiln-demo-dup-b 2.0): error in kiln_register_backends" in text
    assert "kiln-demo-dup-a 1.0" in text and "pip uninstall kiln-demo-dup-b" in text
    assert backends.owner("shared").distribution == "kiln-demo-dup-a"  # type: ignore[union-attr]
    assert [(p.name, p.distribution, p.version) for p in failed_plugins()] == [
        ("kiln_demo_dup_b", "kiln-demo-dup-b", "2.0")
    ]


def test_exceptions_in_installed_plugins_name_the_distribution(fake_dist: Any) -> None:
    fake_dist(
        "kiln-demo-raises",
        """
        import pluggy
        @pluggy.HookimplMarker("kiln")
        def kiln_register_communicators(registry):
            raise RuntimeError("no network")
    """,
    )
    with pytest.warns(KilnWarning, match=r"\(kiln-demo-raises 0.3.0\): error in kiln_register_communicators: "
                                         r"RuntimeError: no network. kiln goes on without it; fix it or "
                                         r"pip uninstall kiln-demo-raises, or set KILN_DISABLE_PLUGIN_AUTO"):
        get_registry("communicators")
    assert _names(list_plugins()) == ["core"]


def test_entry_point_import_failure_is_skipped(fake_dist: Any) -> None:
    fake_dist("kiln-demo-broken", "import kiln_no_such_module_anywhere", version="9.9")
    fake_dist("kiln-demo-fine", "")
    with pytest.warns(KilnWarning, match=r"\(kiln-demo-broken 9.9\): import error: ModuleNotFoundError"):
        assert _names(list_plugins()) == ["core", "kiln_demo_fine"]
    (failed,) = failed_plugins()
    assert (failed.name, failed.distribution, failed.version, failed.module) == (
        "kiln_demo_broken", "kiln-demo-broken", "9.9", "kiln_demo_broken")
    assert failed.status == "failed: import error: ModuleNotFoundError: No module named " \
                            "'kiln_no_such_module_anywhere'"
    assert "matmul" in get_registry("ops")


def test_entry_point_with_a_misspelled_hook_is_skipped(fake_dist: Any) -> None:
    fake_dist(
        "kiln-demo-typo",
        """
        import pluggy
        @pluggy.HookimplMarker("kiln")
        def kiln_register_opz(registry):
            pass
    """,
    )
    with pytest.warns(KilnWarning, match=r"kiln-demo-typo 0.3.0\): declares an invalid hook: unknown hook "
                                         r"'kiln_register_opz'"):
        assert _names(list_plugins()) == ["core"]
    assert failed_plugins()[0].distribution == "kiln-demo-typo"


@pytest.mark.parametrize(
    ("name", "fn"),
    [
        ("kiln_register_backendz", lambda registry: None),  # matches no hookspec
        ("kiln_register_backends", lambda reg: None),  # wrong argument name
    ],
)
def test_bad_hookimpls_at_run_time_are_rejected(name: str, fn: Any) -> None:
    with pytest.raises(PluginError, match=r"plugin 'bad' .* declares an invalid hook"):
        register_plugin(_plugin(**{name: fn}), "bad")
    assert _names(list_plugins()) == ["core"] and failed_plugins() == []


# --- the kiln CLI ---------------------------------------------------------------------------------------


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"kiln {CORE_VERSION}\n"


def test_cli_plugins_lists_core(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    header, core = capsys.readouterr().out.splitlines()
    assert header.split() == ["name", "distribution", "version", "module", "status"]
    assert core.split() == ["core", "kiln-core", CORE_VERSION, "kiln.core", "ok"]


def _command(run: Any) -> types.SimpleNamespace:
    def kiln_cli_commands(register: Any) -> None:
        register("fail", help="fails", run=run)

    return _plugin(kiln_cli_commands=kiln_cli_commands)


def _fail(args: Any) -> int:
    raise KilnError("the model file 'm.py' is missing", hint="pass --model")


def test_cli_errors_exit_2_without_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    register_plugin(_command(_fail), "failing")
    assert main(["fail"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: the model file 'm.py' is missing\n  hint: pass --model")
    assert "Traceback" not in err
    monkeypatch.setenv("KILN_DEBUG", "1")
    assert main(["fail"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_cli_a_command_name_stays_with_the_first_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    def kiln_cli_commands(register: Any) -> None:
        register("thief-own", help="", run=print)
        register("plugins", help="", run=print)

    register_plugin(_plugin(kiln_cli_commands=kiln_cli_commands), "thief")
    assert main(["plugins"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("kiln: warning: plugin 'thief' (registered at run time): error in "
                          "kiln_cli_commands: 'plugins' is registered twice in the cli_commands registry: "
                          f"by plugin 'core' (kiln-core {CORE_VERSION}) and by plugin 'thief'")
    rows = [line.split(maxsplit=4) for line in out.splitlines()]
    assert rows[1] == ["core", "kiln-core", CORE_VERSION, "kiln.core", "ok"]
    assert rows[2][:4] == ["thief", "(run", "time)", "-"]  # its module column follows
    assert "failed: error in kiln_cli_commands: 'plugins' is registered twice" in out.splitlines()[2]
    assert main(["thief-own"]) == 2  # its other command went with it
    assert "invalid choice: 'thief-own'" in capsys.readouterr().err


def test_cli_a_failing_configure_drops_its_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    def configure(parser: Any) -> None:
        raise TypeError("bad option")

    register_plugin(_plugin(kiln_cli_commands=lambda register: register("odd", help="", run=print,
                                                                        configure=configure)), "odd")
    assert main(["--version"]) == 0
    out, err = capsys.readouterr()
    assert out == f"kiln {CORE_VERSION}\n"
    assert err == "kiln: warning: plugin 'odd' (registered at run time): error in kiln_cli_commands: " \
                  "TypeError: bad option. kiln goes on without it\n"


def test_python_dash_m_kiln_core() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kiln.core", "--version"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, AUTOLOAD: "1"},
    )
    assert out.stdout == f"kiln {CORE_VERSION}\n"
