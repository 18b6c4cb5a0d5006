"""Packed rows: several sequences in one row of the batch, as transformers' `DataCollatorWithFlattening` builds them.

A row is packed when it comes without an attention mask and its `position_ids`
restart: a sequence starts wherever the position does not go up by one, which is
how transformers' masking utilities recognise packed rows
(`find_packed_sequence_indices`) and give attention a block-diagonal causal mask.
flash-attention's `cu_seq_lens_q` (one row, `[N + 1]` start offsets) say the same
directly; `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives both.

Attention separates the sequences through that mask (or flash-attention's varlen
path). A Gated DeltaNet layer cannot be masked: its recurrent state and short
convolution would run from one sequence into the next, so it gets the bounds as
`cu_seqlens` instead. What cannot be separated is refused with a ValueError:
restarting positions in a row that also has an attention mask (transformers'
masks ignore positions then), `cu_seq_lens_q` that disagree with the positions,
and (in the model) a cache, which one row of several sequences cannot continue.

Finding the bounds reads the values of `position_ids`: one host sync per eager
forward that passes position_ids (transformers' own check costs the same). While
torch.compile traces, values are unknown and the number of sequences would be
data: `cu_seq_lens_q` are then taken as given, and rows that only bounds could
separate (recurrent layers, or a cache in use) are checked in the graph
(`torch._assert_async`: an error at run time where a row is packed, no graph
break); attention-only models without a cache need nothing, as transformers'
traced masks separate packed rows themselves.
"""

import torch
import torch.nn.functional as F
from transformers.masking_utils import find_packed_sequence_indices


def _sequence_starts(position_ids: torch.Tensor) -> torch.Tensor | None:
    """`[B, T]` positions -> cu_seqlens `[N + 1]` over the rows laid end to end, or None when no row is packed."""
    sequence_index = find_packed_sequence_indices(position_ids)  # [B, T]: which sequence of its row a token is in
    if sequence_index is None:
        return None
    starts = F.pad(sequence_index.diff(dim=-1) != 0, (1, 0), value=True)  # [B, T]: every row starts a sequence
    ends = torch.tensor([starts.numel()], device=starts.device)
    return torch.cat([starts.flatten().nonzero().flatten(), ends]).to(torch.int32)


def packed_sequences(
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | dict | None,
    cu_seq_lens_q: torch.Tensor | None,
    batch_size: int,
    seq_len: int,
    masks_separate: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Find the sequences packed into the rows of a forward's input.

    Returns `(position_ids, cu_seqlens)`: the position ids to use (from
    `cu_seq_lens_q` when none are given, each sequence starting at 0) and int32
    `[N + 1]` offsets of the N sequences in the rows laid end to end (row b's
    tokens are `b * T ... (b + 1) * T - 1`), or None when every row holds one
    sequence. Raises ValueError for packed rows that cannot be separated.
    `masks_separate` says that attention masks alone would separate packed rows
    (no recurrent layer, no cache): only read while compiling.
    """
    if torch.compiler.is_compiling():
        return _traced(position_ids, attention_mask, cu_seq_lens_q, seq_len, masks_separate)
    if cu_seq_lens_q is not None:
        if batch_size != 1 or attention_mask is not None:
            raise ValueError(
                f"cu_seq_lens_q packs sequences into one row without an attention_mask "
                f"(got {batch_size} rows{' and an attention_mask' if attention_mask is not None else ''})"
            )
        cu = cu_seq_lens_q.to(torch.int32)
        if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != seq_len:
            raise ValueError(f"cu_seq_lens_q must be 1-D offsets from 0 to the row's {seq_len} tokens, got {cu.tolist()}")
        if position_ids is None:  # each sequence from position 0, as if it ran alone
            starts = torch.repeat_interleave(cu[:-1].long(), cu.diff().long(), output_size=seq_len)
            return (torch.arange(seq_len, device=cu.device) - starts)[None], cu
        from_positions = _sequence_starts(position_ids)
        if from_positions is None or not torch.equal(from_positions.to(cu.device), cu):
            raise ValueError(
                f"cu_seq_lens_q {cu.tolist()} disagree with where position_ids restart "
                f"({[0, seq_len] if from_positions is None else from_positions.tolist()}): "
                "RoPE and the attention mask follow position_ids"
            )
        return position_ids, cu

    if position_ids is None or seq_len == 1 or isinstance(attention_mask, dict):
        return position_ids, None  # nothing packed, or masks generate() already built
    rows = position_ids.expand(batch_size, -1)  # [B, T]; position_ids may be one row for all
    if attention_mask is None:
        return position_ids, _sequence_starts(rows)
    if attention_mask.dim() == 2:
        # Padding restarts positions next to padded tokens (generate(): pads at 1, the first real token at 0);
        # positions going back between two real tokens are a packed row, which a padding mask cannot separate.
        real = attention_mask[:, -seq_len:].bool()
        goes_back = rows.diff(dim=-1) <= 0
        if bool((goes_back & real[:, 1:] & real[:, :-1]).any()):
            raise ValueError(
                "position_ids restart inside a row that has an attention_mask: packed rows come without one "
                "(as DataCollatorWithFlattening gives them)"
            )
    return position_ids, None


def _traced(position_ids, attention_mask, cu_seq_lens_q, seq_len, masks_separate):
    """`packed_sequences` while torch.compile traces, when no tensor's values can be read."""
    if cu_seq_lens_q is not None:
        if position_ids is None:
            raise ValueError("under torch.compile, cu_seq_lens_q need the position_ids that go with them")
        return position_ids, cu_seq_lens_q.to(torch.int32)
    if position_ids is not None and attention_mask is None and seq_len > 1 and not masks_separate:
        torch._assert_async(
            (position_ids.diff(dim=-1) == 1).all(),
            "packed rows (position_ids restarting) in a compiled forward that only sequence bounds can separate: "
            "pass use_cache=False, and for Gated DeltaNet layers cu_seq_lens_q (their packed path breaks the graph)",
        )
    return position_ids, None
