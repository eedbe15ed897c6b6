"""Hand-written mutants of the ``cache`` assignment (instructor-only: not in a student copy): the mistakes a
student makes in the storage, the grouped scores and the masked attention, and calls to shipped code that
computes an answer. ``python -m course.mutants cache`` grades each with the hidden tests."""

from course.mutants import Mutant

APPEND, SCORES, MASK = "append", "group_scores", "mask"

TEXTBOOK_APPEND = """\
B, H_kv, Tn, d = k.shape
p = pos.expand(B, H_kv, Tn)
if self._k is None:
    self._k, self._v, self._pos = k, v, p
else:
    self._k, self._v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
    self._pos = torch.cat([self.pos, p], dim=2)
self.n += Tn
for name, t in self.state.items():
    self._state[name] = torch.cat([t, t.new_full((B, H_kv, Tn, *t.shape[3:]), self.fill[name])], dim=2)"""

REPLACE_APPEND = """\
p = pos.expand(*k.shape[:3])
if self._k is None:
    self.replace(k, v, p)
else:
    self.replace(torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2), torch.cat([self.pos, p], dim=2))"""

MUTANTS = [
    # -- append: the whole LayerKV.append
    Mutant("the textbook append: torch.cat at every token (copies the whole layer)", APPEND, TEXTBOOK_APPEND),
    Mutant("calls the shipped LayerKV.replace with torch.cat (not in place, drops the state)", APPEND,
           REPLACE_APPEND),
    Mutant("a full buffer grows by the slots needed only, not doubled", APPEND,
           "max(self.n + Tn, MIN_CAPACITY)", "max(self.n + Tn, 2 * self.capacity(), MIN_CAPACITY)"),
    Mutant("a full buffer doubles without checking that the chunk fits", APPEND,
           "max(2 * self.capacity(), MIN_CAPACITY)", "max(self.n + Tn, 2 * self.capacity(), MIN_CAPACITY)"),
    Mutant("the first append leaves no room", APPEND, "cap = Tn if", "cap = Tn + MIN_CAPACITY if"),
    Mutant("reallocates when the chunk exactly fills the buffer (>= for >)", APPEND,
           "if self.n + Tn >= self.capacity():", "if self.n + Tn > self.capacity():"),
    Mutant("a reallocation forgets the stored slots", APPEND, "if was is None:", "if was is not None:"),
    Mutant("the buffers made in float32 whatever the keys' dtype", APPEND,
           "torch.empty(B, H_kv, cap, d), torch.empty(B, H_kv, cap, v.shape[-1])",
           "k.new_empty(B, H_kv, cap, d), v.new_empty(B, H_kv, cap, v.shape[-1])"),
    Mutant("the value buffer sized by the keys' dimension", APPEND,
           "v.new_empty(B, H_kv, cap, d)", "v.new_empty(B, H_kv, cap, v.shape[-1])"),
    Mutant("the room's positions 0, not -1 (empty)", APPEND,
           "pos.new_zeros((B, H_kv, cap))", "pos.new_full((B, H_kv, cap), -1)"),
    Mutant("off by one: writes from slot n + 1", APPEND,
           "self._k[:, :, self.n + 1:end + 1] = k\n        self._v[:, :, self.n + 1:end + 1] = v\n"
           "        self._pos[:, :, self.n + 1:end + 1] = pos",
           "self._k[:, :, self.n:end] = k\n        self._v[:, :, self.n:end] = v\n"
           "        self._pos[:, :, self.n:end] = pos"),
    Mutant("n set to the chunk's size, not advanced by it", APPEND, "self.n = Tn", "self.n = end"),
    Mutant("the per-slot state is not extended", APPEND, "pass",
           "for name, t in self._state.items():           # new slots start at the state's fill value\n"
           "            t[:, :, self.n:end] = self.fill[name]"),
    Mutant("new state slots start at 0, not at the state's fill", APPEND,
           "t[:, :, self.n:end] = 0", "t[:, :, self.n:end] = self.fill[name]"),
    Mutant("a reallocation leaves the states at their old capacity", APPEND, "pass",
           "self._state = {name: t.new_empty(B, H_kv, cap, *t.shape[3:]) for name, t in self._state.items()}"),

    # -- group_scores
    Mutant("no 1/sqrt(d) scale", SCORES, "qg = q.reshape(B, H_kv, H // H_kv * C, d)",
           "qg = q.reshape(B, H_kv, H // H_kv * C, d) / math.sqrt(d)"),
    Mutant("scaled by 1/d, not 1/sqrt(d)", SCORES, "/ d", "/ math.sqrt(d)"),
    Mutant("GQA heads grouped interleaved: query head h reads KV head h % H_kv", SCORES,
           "qg = q.view(B, H // H_kv, H_kv, C, d).transpose(1, 2).reshape(B, H_kv, H // H_kv * C, d) / math.sqrt(d)",
           "qg = q.reshape(B, H_kv, H // H_kv * C, d) / math.sqrt(d)"),
    Mutant("the result viewed (B, H_kv, C, G, T): queries and heads swapped", SCORES,
           ".view(B, H_kv, C, H // H_kv, k.shape[2]).transpose(2, 3)", ".view(B, H_kv, H // H_kv, C, k.shape[2])"),
    Mutant("keys repeated to every query head, then grouped in the wrong order", SCORES,
           "B, H, C, d = q.shape\nH_kv = k.shape[1]\nkr = k.repeat(1, H // H_kv, 1, 1)\n"
           "s = q @ kr.transpose(-1, -2) / math.sqrt(d)\nreturn s.view(B, H_kv, H // H_kv, C, k.shape[2])"),
    Mutant("the query heads grouped with .view (the model's queries are a transpose: it fails there)", SCORES,
           "qg = q.view(B, H_kv, H // H_kv * C, d) / math.sqrt(d)",
           "qg = q.reshape(B, H_kv, H // H_kv * C, d) / math.sqrt(d)"),
    Mutant("scores of each query head against KV head 0 only", SCORES,
           "(qg @ k[:, :1].transpose(-1, -2))", "(qg @ k.transpose(-1, -2))"),

    Mutant("the scores in float32 whatever the queries' dtype (float16 attention then fails)", SCORES,
           "qg = q.float().reshape(B, H_kv, H // H_kv * C, d) / math.sqrt(d)\n"
           "return (qg @ k.float().transpose(-1, -2)).view(B, H_kv, H // H_kv, C, k.shape[2])",
           "qg = q.reshape(B, H_kv, H // H_kv * C, d) / math.sqrt(d)           # the G query heads as rows\n"
           "return (qg @ k.transpose(-1, -2)).view(B, H_kv, H // H_kv, C, k.shape[2])"),

    # -- mask: the masked attention of a chunk
    Mutant("< for <=: a query does not see its own position", MASK, "(kp < pc[:, None])", "(kp <= pc[:, None])"),
    Mutant("empty slots (-1) are attended", MASK, "visible = (kp <= pc[:, None])",
           "visible = (kp <= pc[:, None]) & (kp >= 0)"),
    Mutant("position 0 treated as empty (> 0 for >= 0)", MASK, "(kp > 0)", "(kp >= 0)"),
    Mutant("keep everything: no causal mask, only the empty slots", MASK, "visible = (kp >= 0)",
           "visible = (kp <= pc[:, None]) & (kp >= 0)"),
    Mutant("the mask from slot indices, not positions (slot s holds position s)", MASK,
           "idx = torch.arange(kp.shape[-1])\nvisible = (idx <= pc[:, None]) & (kp >= 0)",
           "visible = (kp <= pc[:, None]) & (kp >= 0)"),
    Mutant("the mask compares the chunk's query index, not its position", MASK,
           "(kp <= torch.arange(C)[:, None])", "(kp <= pc[:, None])"),
    Mutant("every chunk's mask from all of q_pos, not the chunk's own positions pc", MASK,
           "(kp <= q_pos[:, None])", "(kp <= pc[:, None])"),
    Mutant("masked with -1e4, not -inf (a finite fill beats scores below it)", MASK,
           'scores.masked_fill(~visible, -1e4)', 'scores.masked_fill(~visible, float("-inf"))'),
    Mutant("an additive mask of 0 and -inf (a float32 tensor: float16 scores promoted)", MASK,
           'torch.softmax(scores + torch.where(visible, 0.0, float("-inf")), dim=-1)',
           'torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)'),
    Mutant("masked with 0, not -inf (masked slots still get exp(0) weight)", MASK,
           "scores.masked_fill(~visible, 0.0)", "scores.masked_fill(~visible, float(\"-inf\"))"),
    Mutant("softmax over the queries, not the slots", MASK, "dim=-2)", "dim=-1)"),
    Mutant("GQA output heads interleaved: (G, H_kv) order", MASK,
           "outs.append((probs @ v[:, :, None]).transpose(1, 2).reshape(B, H, C, d))",
           "outs.append((probs.view(B, -1, C * H // k.shape[1], Tk) @ v).view(B, H, C, d))"),
    Mutant("the probabilities kept as (B, H_kv, C, G, Tk)", MASK,
           "probs = torch.softmax(scores.masked_fill(~visible, float(\"-inf\")), dim=-1).transpose(2, 3).contiguous()\n"
           "        outs.append((probs @ v[:, :, None]).transpose(2, 3).reshape(B, H, C, d))",
           "probs = torch.softmax(scores.masked_fill(~visible, float(\"-inf\")), dim=-1)\n"
           "        outs.append((probs.view(B, -1, C * H // k.shape[1], Tk) @ v).view(B, H, C, d))"),
    Mutant("calls the course's shipped oracle (course/oracle.py full_attention)", MASK,
           "from course.oracle import full_attention\n"
           "visible = (kp <= pc[:, None]) & (kp >= 0)\n"
           "probs = torch.softmax(scores.masked_fill(~visible, float(\"-inf\")), dim=-1)\n"
           "outs.append(full_attention(qc, k, v, pc, k_pos))"),
]

ACCEPTABLE: dict[str, str] = {}        # every mutant of this assignment is killed
