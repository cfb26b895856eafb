"""Whether a variant answers like the reference: the parity lab, output comparisons, neighbour agreement, and the
fp16/int8 repair with its recipes and per-node error."""
