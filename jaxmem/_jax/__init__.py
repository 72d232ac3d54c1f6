"""The one home for JAX internals that jaxmem relies on.

Everything jaxmem needs from JAX that is not a documented public API lives in this package,
so that a JAX upgrade is a one-folder change (``tests/test_packaging.py`` checks that no
other module imports ``jax._src`` or ``jaxlib``). The tested range is pinned in
``pyproject.toml`` (jax 0.10.x on CPU machines, 0.11.x on the GPU machine). Public JAX API
used elsewhere in jaxmem (``jax.make_jaxpr``, ``jax.checkpoint``, ``jax.ad_checkpoint``,
``jax.extend.core``) is imported directly where it is used.

Every name is importable from here, and jaxmem reads them as ``_jax.<name>`` (so a test that
monkeypatches ``jaxmem._jax.<name>`` reaches every caller). One module per topic:

- :mod:`~jaxmem._jax.jaxprs` — jaxpr types, primitives, the primitive-name tables, reading an
  equation (literals, nested jaxprs, call jaxprs, inlinable ``jit``);
- :mod:`~jaxmem._jax.surgery` — jaxprs and equations rebuilt with new parts
  (:mod:`jaxmem.compiling.shard_map`);
- :mod:`~jaxmem._jax.name_stacks` — name stacks: forward or backward, user scopes,
  re-emitting under an equation's traceback and stack;
- :mod:`~jaxmem._jax.binding` — re-binding a traced equation's primitive;
- :mod:`~jaxmem._jax.avals` — memory space, varying manual axes and shard count of a type;
- :mod:`~jaxmem._jax.memory` — memory kinds and spaces, the device buffers behind an array;
- :mod:`~jaxmem._jax.backends` — backends, visible accelerators, installed plugins;
- :mod:`~jaxmem._jax.remat` — JAX's residual list, trace state, and the trace-time
  ``lax.scan`` and ``jax.grad`` patches (checkpointed scan bodies and losses).
"""

from jaxmem._jax.avals import aval_memory_space, is_floating, shards, varying_axes
from jaxmem._jax.backends import (
    cuda_plugin_installed,
    default_backend_initialized,
    gpu_client_options_from_env,
    has_visible_nvidia_gpu,
    has_visible_tpu,
    initialized_platforms,
    libtpu_installed,
    lowered_platform,
    only_known_plugins,
)
from jaxmem._jax.binding import bind, bind_params, staging_rules
from jaxmem._jax.jaxprs import (
    COND_NAMES,
    CUSTOM_NAMES,
    JIT_NAMES,
    LOOP_NAMES,
    REMAT_NAMES,
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Literal,
    Primitive,
    Var,
    call_jaxpr,
    closed_jaxpr,
    inlined_as_literal,
    is_dropvar,
    is_literal,
    jaxprs_in_params,
    jit_inlinable,
    literal_value,
    name_p,
    optimization_barrier_p,
    primitives,
    sub_jaxprs,
)
from jaxmem._jax.memory import device_space, host_space, memory_kinds, shard_buffers
from jaxmem._jax.name_stacks import (
    concat_name_stack,
    current_name_stack,
    extend_name_stack,
    is_backward,
    is_forward,
    name_stack,
    name_stack_str,
    scopes,
    scopes_of,
    source_context,
    transforms,
    transforms_of,
    user_context,
)
from jaxmem._jax.remat import (
    checkpointed_losses,
    checkpointed_scan_bodies,
    is_tracer,
    saved_residuals,
    trace_context,
    tracing,
    under_differentiation,
)
from jaxmem._jax.surgery import (
    jaxpr_fun,
    live_only,
    replace_params,
    shard_map_kwargs,
    with_eqns,
)

__all__ = [
    "COND_NAMES", "CUSTOM_NAMES", "JIT_NAMES", "LOOP_NAMES", "REMAT_NAMES", "ClosedJaxpr",
    "DropVar", "Jaxpr", "JaxprEqn", "Literal", "Primitive", "Var", "aval_memory_space", "bind",
    "bind_params", "call_jaxpr", "checkpointed_losses", "checkpointed_scan_bodies",
    "closed_jaxpr", "concat_name_stack", "cuda_plugin_installed", "current_name_stack",
    "default_backend_initialized", "device_space", "extend_name_stack",
    "gpu_client_options_from_env", "has_visible_nvidia_gpu", "has_visible_tpu", "host_space",
    "initialized_platforms", "inlined_as_literal", "is_backward", "is_dropvar", "is_forward",
    "is_literal",
    "is_floating", "is_tracer", "jaxpr_fun", "jaxprs_in_params", "jit_inlinable",
    "libtpu_installed", "live_only",
    "literal_value", "lowered_platform", "memory_kinds", "name_p", "name_stack",
    "name_stack_str", "only_known_plugins", "optimization_barrier_p", "primitives",
    "replace_params", "saved_residuals", "scopes", "scopes_of", "shard_buffers",
    "shard_map_kwargs", "shards", "source_context", "staging_rules", "sub_jaxprs",
    "trace_context", "tracing",
    "transforms", "transforms_of", "under_differentiation", "user_context", "varying_axes",
    "with_eqns",
]
