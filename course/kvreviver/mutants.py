"""Hand-written mutants of the ``kvreviver`` assignment (instructor-only, like test_hidden.py): plausible
mistakes in the count sketch's insert and query, in each of their three implementations, and calls to the
other implementations (which the tests take away while one is graded). ``python -m course.mutants kvreviver``
grades them with the catalogue's."""

from course.mutants import Mutant

MUTANTS = [
    # -- insert: VagueSketch.insert (methods/kvreviver_sketch.py) ---------------------------------------------------
    Mutant("insert: no sign hash, values added as they are", "insert",
           old="v_rows = v.to(self.value.dtype).unsqueeze(0) * g",
           new="v_rows = v.to(self.value.dtype).unsqueeze(0).expand(r, n, H_kv, d)"),
    Mutant("the sign hash on the keys too", "insert",
           old="k_rows = k.to(self.key.dtype).unsqueeze(0).expand(r, n, H_kv, d)",
           new="k_rows = k.to(self.key.dtype).unsqueeze(0) * g"),
    Mutant("row 0's signs for every row", "insert",
           old="g = signs.to(self.value.dtype)[..., None, None]",
           new="g = signs[:1].to(self.value.dtype)[..., None, None]"),
    Mutant("an indexed += keeps one token of each shared cell", "insert",
           old="self.key.view(flat).index_add_(0, idx, k_rows.reshape(flat))\n"
               "self.value.view(flat).index_add_(0, idx, v_rows.reshape(flat))",
           new="self.key.view(flat)[idx] += k_rows.reshape(flat)\n"
               "self.value.view(flat)[idx] += v_rows.reshape(flat)"),
    Mutant("the last token of a cell overwrites the others", "insert",
           old="self.key.view(flat).index_add_(0, idx, k_rows.reshape(flat))\n"
               "self.value.view(flat).index_add_(0, idx, v_rows.reshape(flat))",
           new="self.key.view(flat).index_copy_(0, idx, k_rows.reshape(flat))\n"
               "self.value.view(flat).index_copy_(0, idx, v_rows.reshape(flat))"),
    Mutant("insert: an exact dictionary of tokens instead of any sketch", "insert",
           old="self.key.view(flat).index_add_(0, idx, k_rows.reshape(flat))\n"
               "self.value.view(flat).index_add_(0, idx, v_rows.reshape(flat))",
           new="self.exact = getattr(self, 'exact', {})\n"
               "for j, p in enumerate(pos.tolist()):\n"
               "    old_k, old_v = self.exact.get(p, (0.0, 0.0))\n"
               "    self.exact[p] = (old_k + k[j], old_v + v[j])"),
    Mutant("every row hashed like row 0 (one cell index for all rows)", "insert",
           old="idx = (rows * self.width + cells.long()).reshape(-1)",
           new="idx = (rows * self.width + cells[:1].long()).reshape(-1)"),
    Mutant("insert hashes with hash_cells/hash_signs (an injective sketch ignored)", "insert",
           old="cells, signs = self.buckets(pos), self.signs(pos)",
           new="J = pos.view(1, -1).long()\ncells, signs = self.hash_cells(J), self.hash_signs(J)"),
    Mutant("delete adds instead of subtracting (sign ignored)", "insert",
           old="k, v = sign * k.float(), sign * v.float()",
           new="k, v = k.float(), v.float()"),
    Mutant("VagueSketch.insert calls reference_sketch_insert", "insert",
           old="(r, n), (H_kv, d) = cells.shape, self.key.shape[2:]",
           new="from kernels.count_sketch import reference_sketch_insert\n"
               "reference_sketch_insert(self.key, self.value, cells, signs, k, v)\n"
               "return\n"
               "(r, n), (H_kv, d) = cells.shape, self.key.shape[2:]"),
    Mutant("VagueSketch.insert calls the Triton kernel", "insert",
           old="(r, n), (H_kv, d) = cells.shape, self.key.shape[2:]",
           new="from kernels.count_sketch import sketch_insert_triton\n"
               "sketch_insert_triton(self.key, self.value, cells.int(), signs, k, v)\n"
               "return\n"
               "(r, n), (H_kv, d) = cells.shape, self.key.shape[2:]"),
    # -- insert: reference_sketch_insert and its kernel (kernels/count_sketch.py) --------------------------------
    Mutant("reference insert: values without their sign", "insert",
           old="value[i].index_add_(0, cells[i].long(), g * v.to(value.dtype))",
           new="value[i].index_add_(0, cells[i].long(), v.to(value.dtype))"),
    Mutant("reference insert: an indexed += drops collisions", "insert",
           old="key[i].index_add_(0, cells[i].long(), k.to(key.dtype))",
           new="key[i][cells[i].long()] += k.to(key.dtype)"),
    Mutant("reference insert: only the first row", "insert",
           old="for i in range(r):", new="for i in range(1):"),
    Mutant("reference insert calls the Triton kernel", "insert",
           old="for i in range(r):",
           new="sketch_insert_triton(key, value, cells, signs, k, v)\nreturn\nfor i in range(r):"),
    Mutant("kernel insert: a plain store instead of an atomic add", "insert",
           old='tl.atomic_add(key_ptr + dst, kx, mask=mask, sem="relaxed")',
           new="tl.store(key_ptr + dst, kx, mask=mask)"),
    Mutant("kernel insert: values without their sign", "insert",
           old='tl.atomic_add(value_ptr + dst, vx * g[:, None], mask=mask, sem="relaxed")',
           new='tl.atomic_add(value_ptr + dst, vx, mask=mask, sem="relaxed")'),
    Mutant("kernel insert: the row's offset forgotten (every row into row 0)", "insert",
           old="dst = (i * width + c).to(tl.int64)[:, None] * HD + col[None, :]",
           new="dst = c.to(tl.int64)[:, None] * HD + col[None, :]"),
    Mutant("kernel insert: the token's cell read from row 0", "insert",
           old="c = tl.load(cells_ptr + i * n + tok, mask=tok_ok, other=0)",
           new="c = tl.load(cells_ptr + tok, mask=tok_ok, other=0)"),
    Mutant("kernel insert: features masked by the token mask only", "insert",
           old="mask = tok_ok[:, None] & col_ok[None, :]",
           new="mask = tok_ok[:, None] & (col >= 0)[None, :]"),

    # -- query: VagueSketch.query ---------------------------------------------------------------------------------
    Mutant("query: no sign hash, values read without g_i(J)", "query",
           old="v = self.value.reshape(flat).index_select(0, idx).view(r, n, H_kv, d) * g",
           new="v = self.value.reshape(flat).index_select(0, idx).view(r, n, H_kv, d)"),
    Mutant("query: mean instead of median", "query",
           old="return lower_median(k), lower_median(v)",
           new="return k.mean(dim=0), v.mean(dim=0)"),
    Mutant("an exact lookup: row 0's cell only", "query",
           old="return lower_median(k), lower_median(v)",
           new="return k[0], v[0]"),
    Mutant("query: an exact dictionary of tokens instead of any sketch", "query",
           old="return lower_median(k), lower_median(v)",
           new="store = getattr(self, 'exact', {})\n"
               "return (torch.stack([store[p][0] for p in pos.tolist()]),\n"
               "        torch.stack([store[p][1] for p in pos.tolist()]))"),
    Mutant("the upper median for an even number of rows", "query",
           old="return lower_median(k), lower_median(v)",
           new="mid = r // 2\nreturn k.sort(dim=0).values[mid], v.sort(dim=0).values[mid]"),
    Mutant("the average of the two middle rows (quantile 0.5)", "query",
           old="return lower_median(k), lower_median(v)",
           new="return k.quantile(0.5, dim=0), v.quantile(0.5, dim=0)"),
    Mutant("the sign applied after the median (row 0's sign)", "query",
           old="v = self.value.reshape(flat).index_select(0, idx).view(r, n, H_kv, d) * g",
           new="v = self.value.reshape(flat).index_select(0, idx).view(r, n, H_kv, d)\n"
               "v = v.median(dim=0).values[None] * g[0]"),
    Mutant("the median over the features instead of the rows", "query",
           old="return lower_median(k), lower_median(v)",
           new="return (k.median(dim=-1, keepdim=True).values.expand_as(k)[0],\n"
               "        v.median(dim=-1, keepdim=True).values.expand_as(v)[0])"),
    Mutant("query hashes with hash_cells/hash_signs (an injective sketch ignored)", "query",
           old="cells, signs = self.buckets(pos), self.signs(pos)",
           new="J = pos.view(1, -1).long()\ncells, signs = self.hash_cells(J), self.hash_signs(J)"),
    Mutant("VagueSketch.query calls reference_sketch_query", "query",
           old="(r, n), (H_kv, d) = cells.shape, self.key.shape[2:]",
           new="from kernels.count_sketch import reference_sketch_query\n"
               "return reference_sketch_query(self.key, self.value, cells, signs)\n"
               "(r, n), (H_kv, d) = cells.shape, self.key.shape[2:]"),
    Mutant("VagueSketch.query calls the Triton kernel", "query",
           old="(r, n), (H_kv, d) = cells.shape, self.key.shape[2:]",
           new="from kernels.count_sketch import sketch_query_triton\n"
               "return sketch_query_triton(self.key, self.value, cells.int(), signs)\n"
               "(r, n), (H_kv, d) = cells.shape, self.key.shape[2:]"),
    # -- query: reference_sketch_query and the kernel's gather and median --------------------------------------
    Mutant("reference query: mean instead of median", "query",
           old="k_hat, v_hat = k.median(dim=0).values, v.median(dim=0).values",
           new="k_hat, v_hat = k.mean(dim=0), v.mean(dim=0)"),
    Mutant("reference query: values without their sign", "query",
           old="v = value[rows, cells.long()] * signs.to(value.dtype)[..., None, None]",
           new="v = value[rows, cells.long()]"),
    Mutant("reference query: every row reads row 0's cells", "query",
           old="k = key[rows, cells.long()]",
           new="k = key[rows, cells[:1].long()]"),
    Mutant("reference query calls the Triton kernel", "query",
           old="rows = torch.arange(r, device=cells.device)[:, None]",
           new="return sketch_query_triton(key, value, cells, signs)"),
    Mutant("kernel query: the row's offset forgotten", "query",
           old="ptr = cell_ptr + (i * width + c).to(tl.int64)[:, None] * HD + col[None, :]",
           new="ptr = cell_ptr + c.to(tl.int64)[:, None] * HD + col[None, :]"),
    Mutant("kernel query: no token mask in _sketch_row", "query",
           old="c = tl.load(cells_ptr + i * n + tok, mask=tok_ok, other=0)                          # (BLOCK_N,)\n"
               "ptr = cell_ptr + (i * width + c).to(tl.int64)[:, None] * HD + col[None, :]\n"
               "x = tl.load(ptr, mask=tok_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)\n"
               "if SIGNED:\n"
               "    x = x * tl.load(signs_ptr + i * n + tok, mask=tok_ok, other=0.0).to(tl.float32)[:, None]",
           new="c = tl.load(cells_ptr + i * n + tok)\n"
               "ptr = cell_ptr + (i * width + c).to(tl.int64)[:, None] * HD + col[None, :]\n"
               "x = tl.load(ptr, mask=col_ok[None, :], other=0.0).to(tl.float32)\n"
               "if SIGNED:\n"
               "    x = x * tl.load(signs_ptr + i * n + tok).to(tl.float32)[:, None]"),
    Mutant("kernel query: the sign of row 0 for every row", "query",
           old="x = x * tl.load(signs_ptr + i * n + tok, mask=tok_ok, other=0.0).to(tl.float32)[:, None]",
           new="x = x * tl.load(signs_ptr + tok, mask=tok_ok, other=0.0).to(tl.float32)[:, None]"),
    Mutant("kernel query: three rows averaged instead of their median", "query",
           old="est = tl.maximum(tl.minimum(est, b), tl.minimum(tl.maximum(est, b), c))",
           new="est = (est + b + c) / 3"),
    Mutant("kernel query: the 3-row network takes a max for the min", "query",
           old="est = tl.maximum(tl.minimum(est, b), tl.minimum(tl.maximum(est, b), c))",
           new="est = tl.maximum(tl.minimum(est, b), tl.maximum(tl.maximum(est, b), c))"),
    Mutant("kernel query: the upper median by rank", "query",
           old="MID: tl.constexpr = (R - 1) // 2",
           new="MID: tl.constexpr = R // 2"),
    Mutant("kernel query: rank counts rows below or equal as below", "query",
           old="below += tl.where(xj < xa, 1.0, 0.0)",
           new="below += tl.where(xj <= xa, 1.0, 0.0)"),
    Mutant("kernel query: the median as the row with exactly MID rows below (wrong on ties)", "query",
           old="est = tl.where((below <= MID) & (at_or_below > MID), xa, est)",
           new="est = tl.where(below == MID, xa, est)"),
    Mutant("kernel query: a median written for 2 to 4 rows only (row 0 for r >= 5)", "query",
           old="elif R != 1:",
           new="elif R == 2 or R == 4:"),
    Mutant("kernel query: row 0 instead of the median for r other than 1 and 3", "query",
           old="elif R != 1:",
           new="elif R == 0:"),
    Mutant("VagueSketch.insert flattens the tokens with .view (KVReviver hands over a transpose)", "insert",
           "k_rows = k.to(self.key.dtype).view(n, H_kv * d).unsqueeze(0).expand(r, n, H_kv * d).reshape(r, n, H_kv, d)",
           "k_rows = k.to(self.key.dtype).unsqueeze(0).expand(r, n, H_kv, d)"),
    Mutant("reference_sketch_insert flattens cells and tokens with .view", "insert",
           "key[i].view(key.shape[1], -1).index_add_(0, cells[i].long(), k.to(key.dtype).view(k.shape[0], -1))",
           "key[i].index_add_(0, cells[i].long(), k.to(key.dtype))"),
    Mutant("the insert kernel forgets its feature block's offset (program_id(2))", "insert",
           "col = tl.arange(0, BLOCK_F)", "col = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)"),
]

ACCEPTABLE = {
    "off_by_one at kernels/count_sketch.py:205: 0 -> 1":
        "equivalent: the default of a masked load of a cell index; a token past n is never read or written",
    "off_by_one at kernels/count_sketch.py:205: 0 -> -1":
        "equivalent: the default of a masked load of a cell index; a token past n is never read or written",
}
