#!/usr/bin/env bash
# GPU tests as a chain of their own, e.g. beside a long run on the same GPU (so neither's time is a figure to report):
#   JOBS="bench/gpu_jobs_pytest.sh tests/test_train.py -k graph" bash bench/gpu_queue.sh 1
# gpu_queue.sh passes the state folder and the tag after JOBS' own words, which go to pytest.
S=${@: -2:1}; tag=${@: -1}; set -- "${@:1:$#-2}"
source bench/gpu_lib.sh
job pytest_${tag#gpu_jobs_pytest_sh_} timeout 900 python3 -m pytest -q -p no:cacheprovider -m gpu "$@"
touch $S/finished_$tag
