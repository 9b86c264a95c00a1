"""A drafter's d3d settings: what rides along in its `config.d3d` (block size, mask token id, the
target's logits width, the size of its draft vocabulary, the original layers it keeps, its init, its
target, its tokenizer's fingerprint). A leaf, so anything that gives a model these settings (d3d.models.random_models) or
reads them (decoding, training, pruning) imports this and not the drafter builder.

With d3d.models.drafter it is the one room where a drafter's saved facts are read: the settings of a
model (`DrafterSettings.of`) or of a saved folder (`DrafterSettings.of_folder`: its config.json alone,
parsed by d3d.utils.checkpoints.saved_settings, a floor below, where config-time code reads it too),
and its draft vocabulary's map (`draft_map`). Nothing else reads
`config.d3d`, a drafter's config.json or the head's map by name (tests/unit/test_architecture.py):
a misspelt key there silently meant "no settings" or "a full head"."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from d3d.utils.checkpoints import saved_settings

# the name of a DraftHead's map buffer (saved beside the head's weight as `lm_head.d2t`)
DRAFT_MAP = "d2t"


@dataclass
class DrafterSettings:
    block_size: int = 16
    mask_token_id: int = -1
    vocab_size: int = 0  # the target's vocabulary: drafts never leave it
    # rows of its LM head when it drafts over a draft vocabulary (the head's map, `draft_map`, sends
    # them to target ids; d3d.models.drafter.DraftHead); None = the full head, one row per target id
    draft_vocab: int | None = None
    kept_layers: list[int] = field(default_factory=list)  # original layer indices still present
    init: str = "target"
    target: str = ""
    tokenizer_fingerprint: str = ""
    # what a block token sees of its own block (d3d.specs.BLOCK_ATTENTION, d3d.models.masks); folders
    # saved before the choice existed were trained bidirectional
    block_attention: str = "bidirectional"

    @classmethod
    def of(cls, model, required: bool = True) -> "DrafterSettings | None":
        """The settings of a model (or of its transformers config: AutoConfig.from_pretrained reads
        config.json alone). A model without them (the target) is refused, or None when not `required`."""
        raw = getattr(getattr(model, "config", model), "d3d", None)
        if raw is None:
            if not required:
                return None
            raise ValueError("this model has no d3d settings in its config: it is not a d3d drafter checkpoint")
        return cls(**raw)

    @classmethod
    def of_folder(cls, folder: str | os.PathLike) -> "DrafterSettings | None":
        """The settings a saved drafter folder's config.json holds, read without loading the model; None
        for a folder with no readable config.json or no d3d settings in it (a plain model, or a
        PARD-format drafter: d3d.models.drafter.pard_settings gives that one's)."""
        raw = saved_settings(folder)
        return cls(**raw) if raw is not None else None

    def attach(self, model) -> None:
        model.config.d3d = asdict(self)


def draft_map(model_or_head):
    """The draft vocabulary's map of a drafter (or of its LM head): a sorted (N,) tensor of the target
    ids its N head rows score (d3d.models.drafter.DraftHead), or None for a full head."""
    head = model_or_head.get_output_embeddings() if hasattr(model_or_head, "get_output_embeddings") else model_or_head
    return getattr(head, DRAFT_MAP, None)
