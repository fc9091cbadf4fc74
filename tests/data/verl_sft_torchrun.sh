#!/bin/bash
# Hand-written for the check's tests (issue 44): verl's SFT trainer under torchrun, LoRA added in a branch.
nproc_per_node=${NPROC:-4}
extra_args=()
if [ "${USE_PEFT:-1}" = "1" ]; then
    extra_args+=(
        "model.lora_rank=32"
        "model.target_modules=all-linear"
    )
fi
torchrun --standalone --nnodes=1 --nproc_per_node=${nproc_per_node} \
    -m verl.trainer.sft_trainer \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    engine=fsdp \
    model.path=Qwen/Qwen3-8B \
    "${extra_args[@]}" "$@"
