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

from kiln.core._cli import main
from kiln.core._errors import KilnError, PluginError
from kiln.core._hookspecs import hookimpl
from kiln.core._plugins import contribute, get_registry, list_plugins, register_plugin, reset_plugins
from kiln.core._registry import NamedRegistry, PluginInfo

AUTOLOAD = "KILN_DISABLE_PLUGIN_AUTOLOAD"
CORE_VERSION = importlib.metadata.version("kiln-core")


@pytest.fixture(autouse=True)
def core_only(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(AUTOLOAD, "1")
    monkeypatch.delenv("KILN_DEBUG", raising=False)
    reset_plugins()
    yield
    reset_plugins()


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


def test_duplicate_across_distributions_names_both(fake_dist: Any) -> None:
    src = """
        import pluggy
        @pluggy.HookimplMarker("kiln")
        def kiln_register_backends(registry):
            registry.register("shared", object())
    """
    fake_dist("kiln-demo-dup-a", src, version="1.0")
    fake_dist("kiln-demo-dup-b", src, version="2.0")
    with pytest.raises(PluginError) as err:
        get_registry("backends")
    assert "kiln-demo-dup-a 1.0" in str(err.value) and "kiln-demo-dup-b 2.0" in str(err.value)
    assert err.value.distribution == "kiln-demo-dup-b"


def test_get_registry_caches_and_rejects_unknown_kinds() -> None:
    assert get_registry("graph_passes") is get_registry("graph_passes")
    with pytest.raises(KilnError, match="unknown registry kind 'nope'; known: adapters, backends"):
        get_registry("nope")


# --- run-time plugins and contribute ----------------------------------------------------------------


def test_register_plugin_at_run_time() -> None:
    before = get_registry("backends")  # built before the plugin arrives
    info = register_plugin(_backends("toy"), "toy-plugin")
    assert info == PluginInfo("toy-plugin", None, None, "types")
    assert [p.name for p in list_plugins()] == ["core", "toy-plugin"]
    assert "toy" in before and before.owner("toy") == info
    with pytest.raises(PluginError, match="toy-plugin"):
        register_plugin(_backends(), "toy-plugin")  # the name is taken


def test_contribute_attributes_each_entry_to_its_plugin() -> None:
    a = register_plugin(_backends("a1", "a2"), "plug-a")
    b = register_plugin(_backends("b1"), "plug-b")
    reg = contribute("kiln_register_backends", NamedRegistry[Any]("backends"))
    owners = {n: reg.owner(n) for n in reg}
    assert owners.pop("numpy").name == "core"  # core's own backend
    assert owners == {"a1": a, "a2": a, "b1": b}
    register_plugin(_backends("a1"), "plug-c")
    with pytest.raises(
        PluginError, match=r"by plugin 'plug-a' \(registered at run time\) and by plugin 'plug-c'"
    ) as err:
        contribute("kiln_register_backends", NamedRegistry[Any]("backends"))
    assert err.value.plugin == "plug-c" and err.value.__cause__ is None  # passed through unchanged


def test_contribute_wraps_plugin_exceptions_but_passes_kiln_errors() -> None:
    own = KilnError("a plugin's own KilnError")

    def kiln_register_adapters(registry: NamedRegistry[Any]) -> None:
        raise ValueError("boom")

    def kiln_register_communicators(registry: NamedRegistry[Any]) -> None:
        raise own

    register_plugin(_plugin(kiln_register_adapters=kiln_register_adapters), "exploding")
    register_plugin(_plugin(kiln_register_communicators=kiln_register_communicators), "strict")
    with pytest.raises(
        PluginError, match=r"'exploding' .* in kiln_register_adapters: ValueError: boom"
    ) as err:
        get_registry("adapters")
    assert err.value.plugin == "exploding" and isinstance(err.value.__cause__, ValueError)
    with pytest.raises(KilnError) as kerr:
        get_registry("communicators")
    assert kerr.value is own
    with pytest.raises(KilnError, match="not a kiln contribution hook"):
        contribute("kiln_plan_recompute", NamedRegistry[Any]("x"))


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
    with pytest.raises(PluginError, match=r"kiln-demo-raises 0.3.0\) failed in kiln_register_comm") as err:
        get_registry("communicators")
    assert err.value.distribution == "kiln-demo-raises"


@pytest.mark.parametrize(
    ("name", "fn"),
    [
        ("kiln_register_backendz", lambda registry: None),  # matches no hookspec
        ("kiln_register_backends", lambda reg: None),  # wrong argument name
    ],
)
def test_bad_hookimpls_are_rejected(name: str, fn: Any) -> None:
    with pytest.raises(PluginError, match=r"plugin 'bad' .* declares an invalid hook"):
        register_plugin(_plugin(**{name: fn}), "bad")
    assert [p.name for p in list_plugins()] == ["core"]


# --- entry-point loading ------------------------------------------------------------------------------


def test_entry_points_load_unless_autoload_is_disabled(
    fake_dist: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_dist("kiln-demo-ok", "")
    core, demo = list_plugins()
    assert core == PluginInfo("core", "kiln-core", CORE_VERSION, "kiln.core._builtin")
    assert demo == PluginInfo("kiln_demo_ok", "kiln-demo-ok", "0.3.0", "kiln_demo_ok")
    monkeypatch.setenv(AUTOLOAD, "1")
    reset_plugins()
    assert [p.name for p in list_plugins()] == ["core"]


def test_entry_point_import_failure_names_the_distribution(fake_dist: Any) -> None:
    fake_dist("kiln-demo-broken", "import kiln_no_such_module_anywhere", version="9.9")
    with pytest.raises(
        PluginError, match=r"from kiln-demo-broken 9.9 failed to import: ModuleNotFound"
    ) as err:
        list_plugins()
    assert err.value.distribution == "kiln-demo-broken"
    assert isinstance(err.value.__cause__, ModuleNotFoundError)


def test_entry_point_with_a_misspelled_hook_names_the_distribution(fake_dist: Any) -> None:
    fake_dist(
        "kiln-demo-typo",
        """
        import pluggy
        @pluggy.HookimplMarker("kiln")
        def kiln_register_opz(registry):
            pass
    """,
    )
    with pytest.raises(PluginError, match=r"kiln-demo-typo 0.3.0\) declares an invalid hook") as err:
        list_plugins()
    assert err.value.distribution == "kiln-demo-typo"


# --- the kiln CLI ---------------------------------------------------------------------------------------


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"kiln {CORE_VERSION}\n"


def test_cli_plugins_lists_core(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    header, core = capsys.readouterr().out.splitlines()
    assert header.split() == ["name", "distribution", "version", "module"]
    assert core.split() == ["core", "kiln-core", CORE_VERSION, "kiln.core._builtin"]


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


def test_cli_command_names_are_owned(capsys: pytest.CaptureFixture[str]) -> None:
    register_plugin(
        _plugin(kiln_cli_commands=lambda register: register("plugins", help="", run=print)), "thief"
    )
    assert main(["plugins"]) == 2
    err = capsys.readouterr().err
    assert "'plugins' is registered twice" in err and "plugin 'core' (kiln-core" in err and "'thief'" in err


def test_python_dash_m_kiln_core() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kiln.core", "--version"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, AUTOLOAD: "1"},
    )
    assert out.stdout == f"kiln {CORE_VERSION}\n"
