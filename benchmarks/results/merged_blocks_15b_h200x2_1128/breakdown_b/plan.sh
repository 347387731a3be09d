tb 0 29700 egpo_ln_m262k recipes/egpo_qwen15b.yaml --bench-lengths lognormal --egpo_length_sorted_micro_batches true --egpo_loss_forward_block_tokens 262144 & tb 1 29701 grpo_ln_c recipes/grpo_qwen15b.yaml --bench-lengths lognormal; wait
tb 1 29701 egpo_ln_m262k_b recipes/egpo_qwen15b.yaml --bench-lengths lognormal --egpo_length_sorted_micro_batches true --egpo_loss_forward_block_tokens 262144 & tb 0 29700 egpo_ln_m131k_c recipes/egpo_qwen15b.yaml --bench-lengths lognormal --egpo_length_sorted_micro_batches true --egpo_loss_forward_block_tokens 131072; wait
touch /tmp/res/ALLDONE
