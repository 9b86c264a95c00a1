"""A drafter's d3d settings: what rides along in its `config.d3d` (block size, mask token id, the
target's logits width, the size of its draft vocabulary, the original layers it keeps, its init, its
target, its tokenizer's fingerprint). A leaf, so anything that gives a model these settings (d3d.models.random_models) or
reads them (decoding, training, pruning) imports this and not the drafter builder."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DrafterSettings:
    block_size: int = 16
    mask_token_id: int = -1
    vocab_size: int = 0  # the target's vocabulary: drafts never leave it
    # rows of its LM head when it drafts over a draft vocabulary (the head's `d2t` buffer maps them
    # to target ids; d3d.models.drafter.DraftHead); None = the full head, one row per target id
    draft_vocab: int | None = None
    kept_layers: list[int] = field(default_factory=list)  # original layer indices still present
    init: str = "target"
    target: str = ""
    tokenizer_fingerprint: str = ""
    # what a block token sees of its own block (d3d.specs.BLOCK_ATTENTION, d3d.models.masks); folders
    # saved before the choice existed were trained bidirectional
    block_attention: str = "bidirectional"

    @classmethod
    def of(cls, model) -> "DrafterSettings":
        raw = getattr(model.config, "d3d", None)
        if raw is None:
            raise ValueError("this model has no d3d settings in its config: it is not a d3d drafter checkpoint")
        return cls(**raw)

    def attach(self, model) -> None:
        model.config.d3d = asdict(self)
