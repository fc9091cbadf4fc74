#!/bin/bash
# Hand-written for the check's tests (issue 44): the shape of verl's example launchers.
MODEL_DIR=${MODEL_DIR:-openai/gpt-oss-20b}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
train_files="['$HOME/data/gsm8k/train.parquet', '$HOME/data/math/train.parquet']"

DATA=(
    algorithm.adv_estimator=grpo
    data.train_files="$train_files"
    data.train_batch_size=256
)
MODEL=(
    actor_rollout_ref.model.path=${MODEL_DIR}
    actor_rollout_ref.model.enable_gradient_checkpointing=True
)
ACTOR=(
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.fsdp_config.param_offload=False
)
TRAINER=(
    trainer.n_gpus_per_node=${NGPUS_PER_NODE}
    trainer.nnodes=1
)
EXTRA=()

LAUNCH=(python3)
RAY=(ray_kwargs.ray_init.runtime_env.py_executable=null)
if [ "${VERL_USE_UV:-1}" != 0 ]; then
    LAUNCH=(uv run --frozen python3)
    RAY=(ray_kwargs.ray_init.runtime_env.py_executable="uv run --frozen")
fi
"${LAUNCH[@]}" -m verl.trainer.main_ppo \
    "${DATA[@]}" \
    "${MODEL[@]}" \
    "${ACTOR[@]}" \
    "${TRAINER[@]}" \
    "${EXTRA[@]}" \
    "${RAY[@]}" \
    "$@"
