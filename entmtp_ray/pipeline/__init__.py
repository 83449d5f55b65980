"""Running generations: the one place a decoder is assembled, the per-process engine (prompt in, row
out), the Ray Data stage, named tasks and their prompts, and the output rows."""
