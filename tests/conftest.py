import os

# Triton kernels run on CPU tensors under its interpreter; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Two cores: keep torch from oversubscribing them when pytest-xdist is not used.
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
