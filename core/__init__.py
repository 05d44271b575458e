"""The core's parts beyond the design card's files: the engine core (the step loop), the
model runner, the sampler, the output processor, request records and submission, sampling
parameters, outputs, the backend seam, and the weight formats (weight_format.py: what one is;
formats.py: the registry). Plain PyTorch; imports nothing of fast/ or vllm_api/."""
