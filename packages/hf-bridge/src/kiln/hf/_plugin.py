"""The ``kiln`` entry point of kiln-hf: its hook implementations, found by kiln's plugin manager."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("kiln")


def _configure_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the run's TOML config (see docs/training.md)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in the output folder (start if there is none)")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="train on N data-parallel ranks started through the MPI launcher (needs kiln-dist); "
                        "train.batch_size is the global batch, cut into N shards")
    p.add_argument("--debug-nans", action="store_true",
                   help="on a non-finite loss, name the first op that produced a non-finite value; check the "
                        "weights after every optimizer update")
    p.epilog = ("SIGINT (Ctrl-C) and SIGTERM save a checkpoint after the current step. Exit codes: 0 done, "
                "2 config error, 3 data error, 4 non-finite loss, 130 or 143 stopped by SIGINT or SIGTERM "
                "(see docs/training.md).")


def _run_train(args: argparse.Namespace) -> int:
    from kiln.hf._train import run

    return run(args)


def _configure_data(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the run's TOML config (see docs/training.md)")
    p.add_argument("--samples", type=int, default=3, metavar="N", help="how many samples to show (default 3)")


def _run_data(args: argparse.Namespace) -> int:
    from kiln.hf._preview import run

    return run(args)


def _run_demo(args: argparse.Namespace) -> int:
    from kiln.hf._demo import run

    return run(args)


@hookimpl
def kiln_register_weight_formats(registry: Any) -> None:
    from kiln.hf._safetensors import SafetensorsFormat

    registry.register("safetensors", SafetensorsFormat())


@hookimpl
def kiln_cli_commands(register: Callable[..., Any]) -> None:
    register("train", help="train a model as a TOML config says: from scratch or from a HF checkpoint, "
             "every weight or LoRA adapters",
             run=_run_train, configure=_configure_train)
    register("data", help="show what a config trains on: counts, token statistics, packing efficiency "
             "and the first samples, with the tokens left out of the loss set apart", run=_run_data,
             configure=_configure_data)
    register("demo", help="train a tiny Qwen3 and a LoRA adapter on Python's own help texts, in ./kiln-demo "
             "(no downloads, about half a minute on a CPU)", run=_run_demo)


class CheckpointFolders:
    """A HF checkpoint folder as a model source: the model its ``config.json`` describes."""

    what = "HF checkpoint folders"

    def claims(self, arg: str) -> bool:
        from pathlib import Path

        return Path(arg).is_dir()

    def load(self, arg: str, config: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        from kiln.core import KilnError
        from kiln.hf._pretrained import config_bundle

        if config is not None:
            raise KilnError("--config applies to model names; a checkpoint's config.json sets its model")
        return config_bundle(arg), {}


class TrainConfigs:
    """A ``kiln train`` config as a model source: its model and the settings of its training step."""

    what = "kiln train configs (.toml)"

    def claims(self, arg: str) -> bool:
        return arg.endswith(".toml")

    def load(self, arg: str, config: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        from kiln.core import KilnError
        from kiln.hf._train import load_train_config

        if config is not None:
            raise KilnError("--config applies to model names; a train config's [model] sets its model")
        plan: tuple[Any, dict[str, Any]] = load_train_config(arg).plan()
        return plan


@hookimpl
def kiln_register_model_sources(registry: Any) -> None:
    registry.register("hf-checkpoint", CheckpointFolders())
    registry.register("train-config", TrainConfigs())
