"""The store's engine: one `StoreCore` (the ring index, column arenas, sampler, locks of one store) and the parts
that work on it. It sits below persist and the facade (docs/architecture.md): importing it loads neither.

Modules: `core` (StoreCore), `writer` (append, extend, end_episode: the one commit routine; `reservation` and
`pieces_writer`/`pieces`: a batch reserved, copied and committed, whole or in pieces), `reader` (sample, gather,
update_priorities, consistent snapshots; `nstep`), `update` (fields filled later), `consume` (tasks, staleness,
groups, leases: `consume_state`, `leases`, `shared_leases`, `tokens`), `episodes` (episode streams), `stepcheck`
(the per-step fast path's checks).

Usage (what `arrowbuf.store.facade.ExperienceStore` does)::

    core = StoreCore(schema, name, capacity, tier, cols, directory, index, sampler, ...)
    writer, reader = StoreWriter(core), StoreReader(core)
    ids = writer.extend(batch); batch = reader.sample(256)
"""
