#!/usr/bin/env bash
# The mini-scale comparisons on real data that a CPU cannot afford (issues 16 and 20), for one GPU session:
# Table I's ProDiGy and NNM+TrimmedMean rows (CIFAR-10 JPEG copy, Dirichlet 0.1, FedAVG E=10, beta 0.9) and
# Table II's ProDiGy / NNM+TrimmedMean / no-defense rows under no attack, ALIE and SF (real FEMNIST, beta
# 0.9), both variants each; then their reports. Each step has a time cap; results, figures and logs go to
# $OUT (default ./mini-logs); the decoded CIFAR-10 (185 MB) to $DATA (default /tmp/prodigy-data). The caps
# add up to 560 s, for one 600 s device command; a grid cut by its cap resumes from its checkpoints when the
# script runs again with the same $OUT. From a source tree:
#     SHARED=../shared/data bash benchmarks/gpu_mini.sh
# SHARED: the folder holding cifar10-jpeg/ and femnist-leaf-24/ (54 MB together; on a machine that
# cannot see ../shared, copy them next to the tree first). EXTRA="--dry-run" lists the runs without training.
set -u
out=${OUT:-mini-logs}
shared=${SHARED:-../shared/data}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PRODIGY_RESULTS_DIR=$out/results PRODIGY_FIGURES_DIR=$out/figures PRODIGY_DATA_DIR=${DATA:-/tmp/prodigy-data}
export PRODIGY_FEMNIST_DIR=$shared/femnist-leaf-24
py=${PYTHON:-python3}
cli="$py -m prodigy_core.cli"
step() {  # name, time cap in seconds, command...
  local name=$1 cap=$2
  shift 2
  echo "== $name (cap ${cap}s)"
  timeout "$cap" "$@" 2>&1 | tee -a "$out/$name.txt"
}
table1=(table1_cifar10 --mini --only defense=prodigy,nnm+trimmed_mean --only distribution=dirichlet
        --only local_momentum=0.9 --only local_steps=10)
table2=(table2_femnist_n20 --mini --only defense=prodigy,nnm+trimmed_mean,none --only attack=none,alie,sf
        --only local_momentum=0.9)
step data "${CAP_DATA:-40}" $cli data cifar10 --from "$shared/cifar10-jpeg/cifar10-jpeg.tar.gz"
for variant in paper authors; do
  step "table1-$variant" "${CAP_TABLE1:-120}" $cli grid "${table1[@]}" --set variant=$variant ${EXTRA:-}
  step "table2-$variant" "${CAP_TABLE2:-100}" $cli grid "${table2[@]}" --set variant=$variant ${EXTRA:-}
done
# figures/: the paper variant's tables, each *_vs_paper.md with both variants beside the paper's numbers;
# figures/authors/mini/: the authors variant's tables
for table in table1_cifar10 table2_femnist_n20; do
  step report "${CAP_REPORT:-20}" $cli report $table --mini
  step report "${CAP_REPORT:-20}" $cli report $table --mini --set variant=authors --out-dir "$out/figures/authors"
done
