"""Hook specifications: the contract between kiln-core and its plugins.

A plugin is a module (or any object) whose functions are marked with ``@kiln.core.hookimpl`` and
are named after the hooks below; an implementation may accept any subset of the hook's parameters,
by name. Plugins are found through the entry-point group ``kiln``. Contribution hooks
(``kiln_register_*``, ``kiln_cli_commands``) are called once per plugin, in registration order
(core first). The ``kiln_register_*`` hooks are historic: a registry is built the first time it is
asked for, and a plugin registered later is called for every registry already built. Every entry a
plugin adds is recorded with the plugin and distribution that supplied it; a name another plugin
already has stays with the first one. A plugin that fails (it cannot be imported, declares an
invalid hook, claims a taken name or raises from a hook) is skipped with a
:class:`kiln.core.KilnWarning` naming its distribution, and its entries are removed; kiln and the
other plugins go on. ``kiln_plan_recompute`` and ``kiln_cli_commands`` also take hook wrappers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Callable

    from kiln.core.plugins._registry import NamedRegistry

__all__ = ["hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("kiln")
hookimpl = pluggy.HookimplMarker("kiln")


@hookspec(historic=True)
def kiln_register_ops(registry: NamedRegistry[Any]) -> None:
    """Register op types, each with its schema, shape rule, reference kernel and backward rule.

    :param registry: The op registry; call ``registry.register_op(opdef)`` once per op type.
        Registering an op type another plugin already has raises :class:`kiln.core.PluginError`
        (which, escaping the hook, skips the plugin). ``kiln.core.op_registry()`` is this
        registry while it is being built, so ``kiln.core.register_backward_rule`` works from
        inside the hook.

    Every implementation is called; return values are ignored.

    .. versionadded:: 0.1
    """

@hookspec(historic=True)
def kiln_register_kernels(registry: NamedRegistry[Any]) -> None:
    """Register kernels: implementations of registered ops for one backend and dtype.

    :param registry: The kernel table; call ``registry.register_kernel(op, backend, dtype, kernel)``
        once per kernel (dtype ``"*"``: every float type of the backend). A second kernel for the
        same op, backend and dtype raises :class:`kiln.core.PluginError` naming both plugins.

    Every implementation is called; return values are ignored. A backend that lacks a kernel for
    an op fails at compile time, naming both.

    .. versionadded:: 0.5
    """


@hookspec(historic=True)
def kiln_register_backends(registry: NamedRegistry[Any]) -> None:
    """Register backends, the executors of a compiled Program (``numpy``, ``cuda``, ...).

    :param registry: The backend registry; call ``registry.register(name, backend)``.
        A backend runs a Program as planned; it does not re-plan it.

    Every implementation is called; return values are ignored. A plugin whose backend needs
    hardware or heavy libraries should check for them and register nothing when they are absent.

    .. versionadded:: 0.1
    """

@hookspec(historic=True)
def kiln_register_optimizers(registry: NamedRegistry[Any]) -> None:
    """Register optimizers (update rules emitted into a Program's optimizer phase).

    :param registry: The optimizer registry; call ``registry.register(name, optimizer_class)``.

    Every implementation is called; return values are ignored.

    .. versionadded:: 0.5
    """


@hookspec(historic=True)
def kiln_register_graph_passes(registry: NamedRegistry[Any]) -> None:
    """Register graph passes: pure functions from an IR graph to a new IR graph.

    :param registry: The graph-pass registry; call ``registry.register(name, pass_fn)``.
        Passes are applied by name (e.g. LoRA injection, tensor-parallel sharding), never
        implicitly, and must not mutate their input.

    Every implementation is called; return values are ignored.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def kiln_plan_recompute(
    graph: Any, layout: Any, mode: str, training: str, budget: float | None, options: Any
) -> Any:
    """Decide which forward activations to save and which to recompute in the backward pass.

    :param graph: The model's forward graph (the ``Graph`` of its entry module).
    :param layout: A ``kiln.core.recompute.PlanContext``: the model, each repeated block with its
        forward graph, activation-slot hints, the tensors its backward reads, the bytes of every
        tensor and the cost of every op for the shape being compiled.
    :param mode: The planning mode asked for: ``"none"``, ``"dsl"`` (from activation-slot hints),
        ``"auto"`` (under a memory budget) or ``"block"`` (keep only block inputs).
    :param training: The training mode, ``"full"`` or ``"lora"``; slot policies (``always``,
        ``lora_only``, ``fft_only``, ``never``) are gated by it.
    :param budget: The auto planner's budget, the saved activations allowed: bytes (int), a
        fraction of the saved activations without recompute (float), or None for the default (0.5).
    :param options: The remaining planner options, a dict: ``allow_matmul`` (None: replay
        matmuls only when the budget forces it) and ``measure`` (a function from a plan to the
        activation peak of the Program compiled with it, when planning inside ``compile``).

    Return a ``kiln.core.recompute.RecomputePlan`` to replace the built-in planner, or None to
    defer to the next implementation. Stops at the first non-None result (``firstresult``; the
    plugin registered last is asked first); when every implementation defers, the built-in
    planner decides. Hook wrappers (``wrapper=True``) see and may replace the result. kiln checks the plan
    (every replayed op must be computable inside its block) and names the plugin if it is not.
    In 0.3 the ``policy`` parameter became ``training`` and ``layout`` a ``PlanContext``.

    .. versionadded:: 0.1
    """


@hookspec(historic=True)
def kiln_register_weight_formats(registry: NamedRegistry[Any]) -> None:
    """Register weight formats that checkpoints can be read from and written to.

    :param registry: The weight-format registry; call ``registry.register(name, fmt)``. ``fmt``
        has ``detect(path) -> bool`` (whether a file or folder holds this format), ``open(path)``
        (a reader with the interface of ``kiln.hf.Checkpoint``: a context manager over tensor
        names with ``path``, ``info(key)`` (``file``, ``dtype`` as a safetensors name, ``shape``),
        ``shape(key)`` and ``read_into(key, out, index=None)``, which copies a tensor, or its part
        ``index``, into the array ``out``) and ``save(folder, tensors, **options)`` (writes
        ``{name: array}``, returns the files written). kiln-hf registers ``safetensors``, reads a HF
        checkpoint folder with the first registered format that detects it, and writes
        ``safetensors``.

    Every implementation is called; return values are ignored.

    .. versionadded:: 0.1
    """


@hookspec(historic=True)
def kiln_register_adapters(registry: NamedRegistry[Any]) -> None:
    """Register parameter-efficient adapters (such as LoRA) that are applied as graph passes.

    :param registry: The adapter registry; call ``registry.register(name, adapter)``. ``adapter``
        has ``config(**settings)`` (its configuration from plain settings, as a ``kiln train``
        config's ``[<name>]`` table gives them; bad settings raise a ``KilnError`` with a ``key``)
        and ``apply(model, config, **options)`` (a new Model with the adapters, trained in place of
        the base weights). kiln-peft registers ``lora``; ``kiln train`` looks its ``train.mode``
        up here.

    Every implementation is called; return values are ignored.

    .. versionadded:: 0.1
    """


@hookspec(historic=True)
def kiln_register_communicators(registry: NamedRegistry[Any]) -> None:
    """Register communicators, the collective operations used for distributed training.

    :param registry: The communicator registry; call ``registry.register(name, comm)``.

    Every implementation is called; return values are ignored.

    .. versionadded:: 0.1
    """


@hookspec(historic=True)
def kiln_register_model_sources(registry: NamedRegistry[Any]) -> None:
    """Register model sources: what ``kiln plan MODEL`` can read a model from.

    :param registry: The model-source registry; call ``registry.register(name, source)``.
        ``source`` has ``what`` (a phrase for messages, e.g. "HF checkpoint folders"),
        ``claims(arg)`` (whether it reads ``arg``, a path or a name from the command line) and
        ``load(arg, config)``, which returns ``(bundle, settings)``: the model's IR, and the
        training settings the source fixes (a ``kiln train`` config's ``mode``, ``recompute``,
        ``batch``, ``seq``, ``passes``, ...; ``{}`` for none). ``config`` is the ``--config``
        JSON object, or None; a source that takes none raises a ``KilnError`` when given one.
        kiln-core reads IR ``.json`` files; kiln-dsl its registered model names; kiln-hf
        checkpoint folders and ``kiln train`` configs; kiln-dsl-text text-DSL files. The first
        source (in registration order) that claims ``arg`` reads it. A source that also has
        ``model_class(arg, base)`` (the kiln-dsl class of the model, a relative path relative to
        ``base``) lets ``kiln train`` train that model from scratch (``[model] name = arg``).

    Every implementation is called; return values are ignored.

    .. versionadded:: 0.5
    """


@hookspec(firstresult=True)
def kiln_step_time(program: Any, device: str) -> Any:
    """Predict the time of one training step of a compiled Program on a device.

    :param program: The compiled training ``Program`` (``kiln.core.compile``), its shapes bound:
        its steps, their ops and attributes, the shapes of its tensors and its precision recipe.
    :param device: The device named on the command line (``kiln plan --device NAME``), lower
        case, e.g. ``"h100"``.

    Return an object with ``seconds`` (the predicted step time) and ``table()`` (the text
    ``kiln plan`` prints: how the time divides between ops), or None when the plugin does not
    know the device. Stops at the first non-None result (``firstresult``); when every
    implementation returns None, ``kiln plan --device`` is an error naming the device.
    kiln-kernels-cuda answers for NVIDIA GPUs with a roofline from kiln's op costs.

    .. versionadded:: 0.5
    """


@hookspec
def kiln_cli_commands(register: Callable[..., None]) -> None:
    """Add subcommands to the ``kiln`` command line.

    :param register: Call ``register(name, *, help, configure, run)`` once per subcommand:
        ``help`` is the one-line description, ``configure(parser)`` adds arguments to the
        subcommand's ``argparse.ArgumentParser`` (may be None) and ``run(args)`` executes it and
        returns the exit code (None counts as 0). A ``KilnError`` raised by ``run`` is printed as
        ``kiln: error: ...`` and exits with code 2.

    Every implementation is called, in registration order (core first); return values are
    ignored. Hook wrappers (``wrapper=True``) run around the whole call.

    .. versionadded:: 0.1
    """
