"""Every op with a backward rule, whoever registered it, against float64 finite differences."""

from __future__ import annotations

import pytest

from kiln.core import check_op, no_gradient, op_registry

REGISTRY = op_registry()
DIFFERENTIABLE = sorted(name for name, opdef in REGISTRY.items()
                        if opdef.backward is not None and opdef.backward is not no_gradient)


def test_the_registry_has_the_core_op_library() -> None:
    for name in ("matmul", "rmsnorm", "flash_attention", "fused_lm_head_loss", "swiglu", "embedding"):
        assert name in DIFFERENTIABLE, name


@pytest.mark.parametrize("name", [
    "geglu", "add3", "qk_norm", "moe_router", "grouped_gemm", "moe_aux_loss",  # issue 24's new ops
    "mamba_conv1d", "mamba_selective_scan",  # issue 23's Mamba ops
])
def test_the_new_ops_are_in_the_generic_check(name: str) -> None:
    """Each op the seed audits added has a backward rule, so the check above runs it: an op that lost
    its rule would drop out of the parametrized check silently."""
    assert name in DIFFERENTIABLE, name


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_backward_rule_matches_finite_differences(name: str) -> None:
    reports = check_op(REGISTRY[name], REGISTRY)
    assert reports, f"{name}: its samples exercise no differentiable input"
    worst = max(reports, key=lambda r: r.max_rel_error)
    assert worst.max_rel_error <= 1e-6, worst

