"""bench.py's parts, one job each.

* ``workloads``     sizes, the random checkpoint, prompt generation
* ``result``        one system's timed run of one workload (``RunResult``)
* ``threads``       the thread configurations and the busy neighbour
* ``ours``          this engine's runner
* ``peer_hf_generate``, ``peer_hf_generate_batch``   Hugging Face peers, in this process
* ``peer_vllm``     vLLM's CPU build, in a subprocess running ``vllm_script.py``
* ``hashing``       (c) the prefix-cache hash chain alone
* ``ours_profile``  the profile by phase (``--profile``): prefill vs the matmul peak, decode vs
                   the weight-streaming bound, the top ops
* ``machine_load``  the cores other processes kept busy during each run
* ``report``        the one table, token agreement request by request, the hashing table
* ``targets``       the project's targets, each defined once with its bar
"""
