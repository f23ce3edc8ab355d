"""Model zoo: transformer presets built from Hugging Face configs with random weights.

    from autopar import models
    zm = models.build("gpt3-175b", device="meta")      # no weights allocated
    zm = models.build("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, seq=32)
    inputs, targets = zm.example_inputs(batch=2, seq=16)
    loss = zm.loss_fn(zm.model(*inputs), *targets)

Families: ``gpt`` (GPT-2 style blocks, learned positions, tied LM head), ``bert`` (post-norm
encoder with a masked-LM head), ``llama`` (RMSNorm, rotary, SwiGLU, grouped-query attention,
untied head). Presets carry the published shapes; see :data:`PRESETS`.
"""

from autopar.models.zoo import (
    FAMILIES,
    PRESETS,
    ModelSpec,
    ZooModel,
    build,
    preset_names,
    resolve_spec,
)

__all__ = ["FAMILIES", "PRESETS", "ModelSpec", "ZooModel", "build", "preset_names", "resolve_spec"]
