"""The side-by-side benchmark (our policies and the baselines on the same prompts) and run reports."""
