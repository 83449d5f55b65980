"""Topology banks: their schema and files, the policies a bank defines, and how a bank is built from
measurements (rollouts -> rank tables -> growth -> step timing -> sweep). Measuring jobs live in jobs/."""
