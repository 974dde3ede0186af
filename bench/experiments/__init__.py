"""`pagemesh experiment NAME --out DIR`: small, seeded reproductions of the papers' claims on
this machine, each written as DIR/NAME.md with DIR/NAME_*.png plots.

    main.py          flags, the table of experiments; prints the key figure last
    context.py       what every experiment shares: the model (loaded once), engines, warm-up
    report.py        the markdown + PNG writer (machine, date, model, command in every header)
    driver.py        drives an in-process Engine with arrivals in wall-clock time; per-token times
    workload.py      seeded random prompts and lengths
    mesh.py          a `pagemesh up` subprocess for the experiments that go over HTTP

    paged_memory.py  PagedAttention: KV utilization, sequences that fit, paged vs contiguous
    orca.py          ORCA: iteration-level vs request-level batching across arrival rates
    sarathi.py       Sarathi-Serve: inter-token latency vs prefill chunk size
    disagg.py        disaggregated prefill/decode vs one mixed worker, over HTTP
    prefix.py        prefix caching on/off; prefix-aware vs round-robin placement
    cow.py           copy-on-write pages for parallel sampling and beam search
    page_size.py     throughput and KV utilization across page sizes
    diffusion_cache.py  feature caches (interval, First-Block-Cache, TeaCache) vs fewer steps (digits DiT)
    diffusion_samplers.py  digits DiT: steps against quality per sampler, and the few-step student
"""
