"""`pagemesh bench`: a load generator for any OpenAI-compatible server.

datasets.py  conversations made of real tokens (random, shared-prefix, multi-turn)   pure
arrivals.py  request arrival times (Poisson / gamma) for a request rate               pure
stream.py    one streamed response -> TTFT, inter-token gaps, text, usage            pure
metrics.py   per-request results -> the summary (vLLM serving-benchmark definitions) pure
             and the images summary (images/s, latency, server queue/compute times)
client.py    one streamed HTTP request (aiohttp)
runner.py    one load point: warm-up, arrivals, concurrency cap, progress
report.py    printed summary, result JSON, sweep plot
images.py    the images mode: prompts, request bodies, answers, one load point
main.py      flags; a single point or a sweep of rates / concurrencies
"""
