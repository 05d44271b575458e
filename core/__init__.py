"""The core's parts beyond the design card's files: the engine core (the step loop), the
model runner, the sampler, the output processor, request records and submission, sampling
parameters, outputs, and the backend seam. Plain PyTorch; imports nothing of fast/ or vllm_api/."""
