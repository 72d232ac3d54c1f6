"""MaxText's ``remat_policy`` presets as ``jax.checkpoint`` policies over MaxText's tensor names.

MaxText (AI-Hypercomputer/maxtext, ``src/maxtext/layers/decoders.py``: ``Decoder.minimal_policy``
and ``Decoder.get_remat_policy``; the offload name lists in
``src/maxtext/utils/maxtext_utils.py``: ``get_save_and_offload_names``) wraps every decoder layer
in ``nn.remat`` and picks that remat's policy by a config string. Each policy only looks at
``jax.ad_checkpoint.checkpoint_name`` tags that the layer puts on its tensors (:data:`NAMES`); a
model that tags its layers the same way can be compared with MaxText's presets one for one.

Each :data:`PRESETS` entry is a :class:`Preset`: a policy (call it like any ``jax.checkpoint``
policy) that also says which names it keeps on the device (``save``) and which it parks in host
memory (``offload``); everything else inside the layer is recomputed in the backward pass.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.ad_checkpoint import checkpoint_name
  >>> layer = lambda x: jnp.sin(checkpoint_name(x @ x, "out_proj"))
  >>> f = jax.checkpoint(layer, policy=PRESETS["save_out_proj"])
  >>> jax.grad(lambda x: f(x).sum())(jnp.eye(2)).shape
  (2, 2)
  >>> PRESETS["minimal_offloaded"].offload[:3]
  ('query_proj', 'key_proj', 'value_proj')
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["NAMES", "PRESETS", "Preset"]

#: The tensor names a decoder layer tags, in the order the layer makes them (MaxText's names).
NAMES: tuple[str, ...] = (
    "decoder_layer_input",  # the layer's input (the residual stream), before the first norm
    "query_proj",  # queries after the projection and rotary embedding
    "key_proj",  # keys after the projection and rotary embedding
    "value_proj",  # values after the projection
    "context",  # attention output (softmax(q k^T) v), before the output projection
    "out_proj",  # attention output projection
    "mlpwi_0",  # MLP gate projection, before silu
    "mlpwi_1",  # MLP up projection
    "mlpwo",  # MLP down projection
)

_QKV = ("query_proj", "key_proj", "value_proj")
_PROJECTIONS = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")


@dataclasses.dataclass(frozen=True)
class Preset:
    """A MaxText ``remat_policy``: a ``jax.checkpoint`` policy over :data:`NAMES`.

    Attributes:
      name: MaxText's config string (``"minimal"``, ``"qkv_proj_offloaded"``, ...).
      save: names kept in device memory for the backward pass.
      offload: names moved to ``pinned_host`` after they are made and back before their use.
      doc: one line saying what the preset keeps and what it recomputes.
    """

    name: str
    save: tuple[str, ...]
    offload: tuple[str, ...]
    doc: str

    @functools.cached_property
    def _policy(self) -> Callable[..., Any]:
        # The same JAX builders MaxText calls: save_only_these_names unless something moves.
        if not self.offload:
            return jax.checkpoint_policies.save_only_these_names(*self.save)
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=self.save,
            names_which_can_be_offloaded=self.offload,
            offload_src="device",
            offload_dst="pinned_host",
        )

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> Any:
        return self._policy(prim, *avals, **params)


def _preset(name: str, doc: str, save: tuple[str, ...] = (), offload: tuple[str, ...] = ()):
    return name, Preset(name, save, offload, doc)


#: MaxText's presets by config string, in MaxText's order (fastest, most memory first), plus
#: the ``custom`` setting that offloads the layer input (MaxText's ``rl.yml`` uses it).
PRESETS: dict[str, Preset] = dict([
    _preset("minimal_with_context", "save every projection and the attention context",
            save=(*_PROJECTIONS, "context")),
    _preset("minimal", "save every projection (q, k, v, out, wi_0, wi_1, wo); recompute "
            "norms, rotary, attention and silu", save=_PROJECTIONS),
    _preset("save_dot_with_context_except_mlp", "save q, k, v, the context and out_proj; "
            "recompute the whole MLP", save=(*_QKV, "context", "out_proj")),
    _preset("save_dot_except_mlpwi", "save q, k, v, out_proj and the MLP output; recompute the "
            "MLP's two input projections", save=(*_QKV, "out_proj", "mlpwo")),
    _preset("save_dot_except_mlp", "save q, k, v and out_proj; recompute the whole MLP",
            save=(*_QKV, "out_proj")),
    _preset("save_qkv_proj", "save q, k and v; recompute attention and the MLP", save=_QKV),
    _preset("qkv_proj_offloaded", "offload q, k and v to host memory; recompute the rest",
            offload=_QKV),
    _preset("minimal_offloaded", "offload every projection to host memory; recompute norms, "
            "rotary, attention and silu", offload=_PROJECTIONS),
    _preset("save_out_proj", "save the attention output projection only", save=("out_proj",)),
    _preset("full", "save nothing inside the layer: recompute it all from its input "
            "(MaxText maps this to policy=None, which jax.checkpoint reads as save nothing)"),
    _preset("decoder_layer_input_offloaded", "MaxText custom with decoder_layer_input: offload; "
            "offload the layer input, recompute the whole layer from it",
            offload=("decoder_layer_input",)),
])
