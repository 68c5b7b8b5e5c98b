#!/usr/bin/env bash
# second device call: the segfault under GradScaler (faulthandler stacks), the PowerSGD bench
set -u
out=$1
export LD_LIBRARY_PATH="$PWD/.gpu-deps/prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
b=build-gpu
nccl_root=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
cmake -S . -B $b -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native \
  -DCMAKE_CUDA_FLAGS=-lineinfo -DCMAKE_PREFIX_PATH=$PWD/.gpu-deps/prefix -DGRADCOMP_BUILD_PYTHON=ON \
  -DGRADCOMP_BUILD_TESTS=OFF -DGRADCOMP_BUILD_BENCH=OFF -DPython_EXECUTABLE=$(command -v python3) \
  -DGRADCOMP_NCCL_ROOT=$nccl_root > $out/build2.log 2>&1
timeout 200 cmake --build $b -j 16 >> $out/build2.log 2>&1 || { tail -20 $out/build2.log; exit 1; }
echo "$(date -u +%T) built"
mkdir -p $b/pyroot && cp -r python_bindings/gradcomp $b/pyroot/ && cp $b/python_bindings/_C*.so $b/pyroot/gradcomp/
export PYTHONPATH=$PWD/$b/pyroot
cd tests/python
for t in "quant-bits4" "onebit-" "powersgd-rank2"; do
  echo "== $t"
  timeout 60 python3 -m pytest -x -q -s -p no:cacheprovider "test_gpu.py::test_fp16_grad_scaler_overflow_steps_are_skipped[$t]" 2>&1 | grep -v "site-packages/_pytest\|site-packages/pluggy" | head -150
done > $out/segv.log 2>&1
cd ../..
echo "$(date -u +%T) segv runs done"
timeout 120 python3 bench/gpu_bench.py --device cuda --out $out --commit "$2" --sections copy,powersgd --max-seconds 110 > $out/gpu_bench2.log 2>&1
echo "$(date -u +%T) bench rc $?"
