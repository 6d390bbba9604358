#!/bin/bash
# After CI: the reproductions on the original code (/work/main, its built libraries),
# then the regression tests on the worktree's fixed code.
W=/work/wt-attack; M=/work/main
PY=$M/.venv/bin/python
pp() { echo "$W:$1/libs/common:$1/libs/cli:$1/services/webhook:$1/services/scheduler:$1/services/inventory:$1/services/deviceplugin"; }
asan_env() { echo "LD_PRELOAD=$(ldd $1/native/build/asan/libgsengine.so | awk '/libasan|libubsan/{print $3}' | paste -sd:) ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 GPUSLICE_NATIVE_DIR=$1/native/build/asan"; }
cd $W
case "$1" in
orig-uaf-sim) env $(asan_env $M) PYTHONPATH=$(pp $M) $PY tests/attack/attack_uaf_simulated.py 2>&1 | grep -v "^    #[0-9][0-9]" | head -40 ;;
orig-uaf-race) env $(asan_env $M) PYTHONPATH=$(pp $M) timeout 200 $PY tests/attack/attack_uaf_race.py ${2:-200} 2>&1 | head -40 ;;
orig-nan) env $(asan_env $M) PYTHONPATH=$(pp $M) $PY tests/attack/attack_nan_mix.py 2>&1 | head -30 ;;
orig-boundary) env $(asan_env $M) PYTHONPATH=$(pp $M) $PY tests/attack/attack_boundary.py $2 2>&1 | head -20 ;;
orig-containers) GPUSLICE_NATIVE_DIR=$M/native/build PYTHONPATH=$(pp $M) timeout 300 $PY tests/attack/attack_containers.py $2 $3 2>&1 | tail -5 ;;
build) make -C native build/libgsengine.so build/asan/libgsengine.so 2>&1 | tail -3 ;;
fixed-tests) env $(asan_env $W) PYTHONPATH=$(pp $W) $PY -m pytest -q -x -p no:randomly -p no:cacheprovider tests/test_engine_attack.py tests/test_engine.py tests/test_engine_compiled.py tests/test_fragmentation.py 2>&1 | tail -15 ;;
esac
