"""The intermediate representation every stage imports (the ground floor beside ``megaegg/dims.py``).

- ``dimform``: the ONE normal form of Dim expressions (sum of products, like terms collected),
  with the queries every stage asks of it (equal values, constant differences, signs, products);
- ``dimsort``: the e-graph simplifier of Dims, seeded with that normal form;
- ``footprint``: what an instance reads or writes per dim (``Full``, ``Tile``, ``At``, ``Span``);
- ``layout``: shape:stride layouts of Dims and the views that compose into them;
- ``program``: the :class:`BlockProgram` the rewrite stage hands to lowering (block ops, buffers, operands).
"""

from .footprint import At, Full, Span, Tile
from .program import BlockOp, BlockProgram, Buffer, Operand, View

__all__ = ["At", "Full", "Span", "Tile", "BlockOp", "BlockProgram", "Buffer", "Operand", "View"]
