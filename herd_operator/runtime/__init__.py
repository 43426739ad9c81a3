"""The operator process: what implements the controllers' ports and runs them.

`operator` wires and runs everything (the manager); `allocator` owns the pool;
`store` is the SQLite state; `specdir` watches the spec directory; `launcher` runs
and stops job processes; `engines/` says how each kind of job is launched and told
of its placement; `pools/` says where the GPUs come from; `metrics` and `observer`
export and sample. Imports neither the CLI nor the benchmarks.
"""
