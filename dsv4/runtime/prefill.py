"""A prompt fed to a model: eager chunks (Transformer.prefill), or, where a session captured
prefill chunk graphs (dsv4.runtime.prefill_graphs) and their replay measured faster, pieces
replayed from them. Either way the state and the logits are those of token-by-token decoding."""
from __future__ import annotations

import torch

from ..model.transformer import progress_bar


@torch.inference_mode()
def prefill(model, ids: torch.Tensor, start: int = 0, chunk: int | None = None,
            progress: bool = False, mtp: bool = False, graphs=None) -> torch.Tensor:
    """Feed ids [s] int64 at positions start..start+s-1 -> logits [V] f32 of the last one, as
    Transformer.prefill (start == 0 resets the state; chunk: default rt.prefill_chunk; progress:
    a bar on stderr for long prompts; mtp: the MTP block follows). graphs: a PrefillGraphs of the
    model (default model.prefill_graphs): the pieces of at most `chunk` rows that its plan picks
    replay its graphs instead (not with mtp: the MTP block follows eager chunks only)."""
    graphs = model.prefill_graphs if graphs is None else graphs
    if graphs is None or mtp:
        return model.prefill(ids, start, chunk, progress, mtp)
    s = ids.shape[0]
    chunk = model.check_prefill(s, start, chunk)
    if start == 0:
        model.reset()
    ids = ids.to(model.head_device)
    h = out = None
    with progress_bar(s, chunk, progress) as bar:
        pos = start
        for rows, graphed in graphs.plan(s, chunk):
            piece = ids[pos - start:pos - start + rows]
            if graphed:
                out, h = graphs.replay(piece, pos), None
                if bar is not None:
                    bar.update(rows)
            else:
                h = model.feed(piece, pos, chunk, bar=bar)
            pos += rows
    if h is None:
        return out.clone()
    return model.logits(h[-1:].to(model.head_device))
