import os, sys
sys.path.insert(0, "tests/python")
os.environ["GRADCOMP_TEST_DEVICE"] = "cuda"
import test_gpu  # noqa: E402
from ddp_util import free_port  # noqa: E402
name = sys.argv[1]
opts = {"quant": {"bits": 4}, "onebit": {}, "powersgd": {"rank": 2}}[name]
test_gpu._entry(0, 1, free_port(), test_gpu._scaler, (name, opts))
print("no crash", name)
