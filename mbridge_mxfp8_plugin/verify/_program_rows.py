"""Which item of a batch a program of the verifier's kernels works on (imported only where
Triton is installed).

A batch is one launch over its items' chunks of blocks; each item's row of the launch table holds
the first program of its chunks. The program finds its row by counting the rows whose first
program is at most its own: one vector load of a column of a small table, where a per-program
table of item indices cost 4 bytes per 64 blocks (about 8 MiB kept by a full check's plan at 4B
parameters, and a Python list as long to build at plan time).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Rows of a table a kernel searches (one vector load each program): a batch with more items is
#: a launch per segment of this many (``fused``). One size, so the kernels compile once for it.
MAX_ROWS = 64


@triton.jit
def program_row(items_ptr, rows, p, WIDTH: tl.constexpr, FIELD: tl.constexpr, ROWS: tl.constexpr):  # noqa: N803
    """The row of ``items`` (``WIDTH`` int64 fields, the first program in column ``FIELD``,
    ascending) that program ``p`` works on: the last whose first program is at most ``p``."""
    r = tl.arange(0, ROWS)
    firsts = tl.load(items_ptr + r.to(tl.int64) * WIDTH + FIELD, mask=r < rows, other=1 << 62)
    row = tl.sum((firsts <= p).to(tl.int32), axis=0) - 1
    return items_ptr + row.to(tl.int64) * WIDTH
