"""Hand-written mutants of the ``chunkkv`` assignment (instructor-only): plausible student mistakes, one per
mutant, for ``python -m course.mutants chunkkv``. Each must lose at least half of its task's points."""

from course.mutants import Mutant

MUTANTS = [
    # chunk_ranking: Algorithm 1's whole-chunk choice
    Mutant("chunks ranked by their mean vote", "chunk_ranking",
           "chunk_score = chunk_score / chunk_size_free.clamp(min=1)\n"
           "chunk_score = chunk_score.masked_fill(chunk_size_free == 0, float(\"-inf\"))",
           "chunk_score = chunk_score.masked_fill(chunk_size_free == 0, float(\"-inf\"))"),
    Mutant("chunks ranked by their best single vote", "chunk_ranking",
           "s.new_zeros(B, H_kv, C).scatter_reduce_(-1, chunk, s, \"amax\")",
           "s.new_zeros(B, H_kv, C).scatter_add_(-1, chunk, s)"),
    Mutant("shared ignored: every head ranks its own chunks", "chunk_ranking", "if False:", "if shared:"),
    Mutant("shared ranking from the first KV head only", "chunk_ranking",
           "chunk_score[:, :1].expand(B, H_kv, C)", "chunk_score.sum(dim=1, keepdim=True).expand(B, H_kv, C)"),
    Mutant("shared ranking summed over the batch rows too", "chunk_ranking",
           "chunk_score.sum(dim=(0, 1), keepdim=True).expand(B, H_kv, C)",
           "chunk_score.sum(dim=1, keepdim=True).expand(B, H_kv, C)"),
    Mutant("every chunk counted as chunk_size tokens", "chunk_ranking",
           "s.new_full((B, H_kv, C), float(chunk_size))",
           "s.new_zeros(B, H_kv, C).scatter_add_(-1, chunk, free.float())"),
    Mutant("a chunk must fit strictly (< for <=)", "chunk_ranking",
           "sizes.cumsum(-1) < n_free[..., None]", "sizes.cumsum(-1) <= n_free[..., None]"),
    Mutant("the worst chunks first", "chunk_ranking", "descending=False", "descending=True"),
    Mutant("every chunk that fits alone (no running total)", "chunk_ranking",
           "(sizes <= n_free[..., None])", "(sizes.cumsum(-1) <= n_free[..., None])"),
    Mutant("protected and empty slots kept with their chunk (no & free)", "chunk_ranking",
           "keep = kept_chunk.gather(-1, chunk)", "keep = kept_chunk.gather(-1, chunk) & free"),
    Mutant("chunks by slot index, not by position", "chunk_ranking",
           "torch.arange(T, device=pos.device).expand_as(pos) // chunk_size", "pos // chunk_size"),
    Mutant("an empty slot's pos -1 used as a chunk index (chunk -1)", "chunk_ranking",
           "chunk = pos // chunk_size", "chunk = torch.where(free, pos // chunk_size, torch.zeros_like(pos))"),
    Mutant("protected slots' votes counted (+inf)", "chunk_ranking",
           "s = scores.float()", "s = torch.where(free, scores.float(), torch.zeros((), device=scores.device))"),
    Mutant("one chunk too many: the first that does not fit is taken too", "chunk_ranking",
           "((sizes.cumsum(-1) - sizes) < n_free[..., None])", "(sizes.cumsum(-1) <= n_free[..., None])"),
    Mutant("the last chunk of the ranking wins ties (stable sort dropped, reversed)", "chunk_ranking",
           "order = torch.sort(chunk_score.flip(-1), dim=-1, descending=True, stable=True).indices\n"
           "order = C - 1 - order",
           "order = torch.sort(chunk_score, dim=-1, descending=True, stable=True).indices"),

    # holds_position: the lookup of layer-wise index reuse
    Mutant("-1 in chosen marks the padding column, read by empty slots", "holds_position",
           "", "table[..., seen] = False"),
    Mutant("chosen read as slot indices, not positions", "holds_position",
           "return table.gather(-1, torch.where(pos < 0, seen, torch.arange(pos.shape[-1]).expand_as(pos)))",
           "return table.gather(-1, torch.where(pos < 0, seen, pos))"),
    Mutant("one table for all the heads", "holds_position",
           "table = table.any(1, keepdim=True).expand_as(table).clone()\ntable[..., seen] = False",
           "table[..., seen] = False"),
    Mutant("an empty slot (-1) looked up as position 0", "holds_position",
           "return table.gather(-1, pos.clamp(min=0))", "return table.gather(-1, torch.where(pos < 0, seen, pos))"),
    Mutant("off by one in the lookup", "holds_position",
           "torch.where(pos < 0, seen, pos + 1)", "torch.where(pos < 0, seen, pos)"),
    Mutant("positions not chosen (negated)", "holds_position",
           "return ~table.gather(-1, torch.where(pos < 0, seen, pos))",
           "return table.gather(-1, torch.where(pos < 0, seen, pos))"),
    Mutant("the first chosen position only", "holds_position",
           "torch.where(chosen[..., :1] < 0, seen, chosen[..., :1])", "torch.where(chosen < 0, seen, chosen)"),
    Mutant("batch rows mixed: the first row's table for every row", "holds_position",
           "return table[:1].expand_as(table).gather(-1, torch.where(pos < 0, seen, pos))",
           "return table.gather(-1, torch.where(pos < 0, seen, pos))"),
    Mutant("every slot of a chosen chunk (the reused layer keeps positions, not chunks)", "holds_position",
           "return table.gather(-1, torch.where(pos < 0, seen, pos)) | table.gather(-1, torch.where(pos < 0, seen, "
           "(pos - 1).clamp(min=0)))",
           "return table.gather(-1, torch.where(pos < 0, seen, pos))"),
    Mutant("a sort without stable=True (ties past 16 chunks reordered on a CPU)", "chunk_ranking",
           "torch.sort(chunk_score, dim=-1, descending=True)",
           "torch.sort(chunk_score, dim=-1, descending=True, stable=True)"),
    Mutant("topk for the sort (its order of ties)", "chunk_ranking", "chunk_score.topk(C, dim=-1)",
           "torch.sort(chunk_score, dim=-1, descending=True, stable=True)"),
    Mutant("ties broken by a small epsilon on the chunk index", "chunk_ranking",
           "torch.sort(chunk_score - 1e-6 * torch.arange(C), dim=-1, descending=True, stable=True)",
           "torch.sort(chunk_score, dim=-1, descending=True, stable=True)"),
    Mutant("chunk sums in float16", "chunk_ranking", "scores.half()", "scores.float()"),
    Mutant("the number of chunks from the first head's positions", "chunk_ranking",
           "C = int(pos[0, 0].max()) // chunk_size + 1", "C = int(chunk.max()) + 1"),
    Mutant("a head's empty chunks sunk to -inf before the shared sum", "chunk_ranking",
           "chunk_score = chunk_score.masked_fill(chunk_size_free == 0, float(\"-inf\"))\nif shared:",
           "if shared:"),
    Mutant("the chunk grid starts at the first free position", "chunk_ranking",
           "start = torch.where(free, pos, pos.max() + 1).amin(-1, keepdim=True)\n"
           "chunk = torch.where(free, (pos - start) // chunk_size, torch.zeros_like(pos))",
           "chunk = torch.where(free, pos // chunk_size, torch.zeros_like(pos))"),
    Mutant("position lookup: -1 clamped to 0 and scattered (the last write wins)", "holds_position",
           "table.scatter_(-1, chosen.clamp(min=0), chosen >= 0)",
           "table.scatter_(-1, torch.where(chosen < 0, seen, chosen), True)"),
    Mutant("position lookup table sized by the largest held position, not seen", "holds_position",
           "table = torch.zeros(*pos.shape[:2], int(pos.max()) + 2, dtype=torch.bool, device=pos.device)\n"
           "seen = table.shape[-1] - 1",
           "table = torch.zeros(*pos.shape[:2], seen + 1, dtype=torch.bool, device=pos.device)"),
]

ACCEPTABLE = {
    "reduction at methods/chunkkv.py: chunk.max() -> chunk.sum()":
        "equivalent: more chunk columns than chunks; the extra ones hold no free slot, score -inf and are never "
        "taken",
    "off_by_one at methods/chunkkv.py: 1 -> 2":
        "equivalent, in both regions: one more chunk column (no free slot, never taken), or one more column in "
        "the position table (never written, never read)",
    "compare at methods/chunkkv.py: sizes > 0 -> sizes >= 0":
        "equivalent: a chunk without a free slot may be marked kept, but only free slots read the mark (& free)",
}
