"""What a caller asks of its embeddings beyond the model's own files (LLMEngine.embed's keywords; an embed job's
--dimensions, --normalize, --prefix, --no-truncate): a prefix before every text, truncation or an error row for an
over-long text, Matryoshka truncation of the vector and L2 normalization.

Matryoshka: Kusupati et al., "Matryoshka Representation Learning" (NeurIPS 2022): the first N elements of a vector
trained so are an embedding of their own; compared by cosine, they are L2-normalized after the cut (as OpenAI's
`dimensions` and sentence-transformers' truncate_dim followed by normalization give them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class EmbedOptions:
    """Options of one embed call.

    Attributes:
        dimensions: keep the first N elements of each pooled vector, then L2-normalize it (Matryoshka); None: the
            whole vector. Checked against the model's width by `check`.
        normalize: L2-normalize each vector after pooling, whatever the model's files say (they may already).
        prefix: text put before every text before it is tokenized ("query: ", "passage: "); its tokens count in
            num_prompt_tokens and in the model's max_seq_length.
        truncate: cut an over-long text at the model's max_seq_length (the row says `truncated`); False: such a text
            is an error output naming its length and the limit.

    Raises:
        ValueError: dimensions not None or an int >= 1; normalize / truncate not bools; prefix not a string.
    """

    dimensions: int | None = None
    normalize: bool = False
    prefix: str = ""
    truncate: bool = True

    def __post_init__(self) -> None:
        n = self.dimensions
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"dimensions must be None or an int >= 1 (elements kept of each embedding), got {n!r}")
        for name in ("normalize", "truncate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.prefix, str):
            raise ValueError(f"prefix must be a string (put before every text), got {type(self.prefix).__name__}")

    def check(self, width: int) -> int:
        """The width of the vectors these options give for a model whose pooled vectors have `width` elements.
        Raises ValueError when dimensions > width."""
        if self.dimensions is not None and self.dimensions > width:
            raise ValueError(f"dimensions {self.dimensions} is more than the model's {width} elements per embedding; "
                             f"ask for 1 to {width}")
        return width if self.dimensions is None else self.dimensions

    def apply(self, pooled: torch.Tensor) -> torch.Tensor:
        """float32 [B, width] pooled vectors -> [B, dimensions or width]: cut to the first `dimensions` elements and
        L2-normalized, or L2-normalized when `normalize`, else as they are."""
        if self.dimensions is not None:
            return F.normalize(pooled[:, :self.dimensions], p=2, dim=-1)
        return F.normalize(pooled, p=2, dim=-1) if self.normalize else pooled
