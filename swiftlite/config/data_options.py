"""The training data's options (`RunConfig.data`): sources, length, rendering and how rows become
batches. A section of schema.RunConfig, kept here so that schema.py stays short; its flags, `--help`
and config-file keys are generated from these fields like every other section's.
"""

from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.access import Section, opt

TRUNCATION = ("delete", "left", "right", "split")
#: ms-swift template names --template takes besides a Jinja file (their Jinja: data/templates.py).
TEMPLATE_NAMES = ("default",)
#: ms-swift's --agent_template names available here (data/agent.py).
AGENT_TEMPLATES = ("hermes", "react_en", "react_zh", "react_grpo")


@dataclass(kw_only=True)
class DataConfig(Section):
    dataset: list[str] = opt(help="Training data: files or HF dataset folders; `path#N` takes N rows.",
                             factory=list)
    val_dataset: list[str] = opt(help="Validation data (same forms as --dataset).", factory=list)
    cached_dataset: list[str] = opt(help="Tokenized training rows written by `swiftlite export --to_cached_dataset "
                                    "true` (its OUT/train folder; `DIR#N` takes N rows), as ms-swift's; read "
                                    "instead of tokenizing, after --dataset's rows when both are given. Refused "
                                    "when the folder was made for another task or tokenizer; rows longer than "
                                    "--max-length follow --truncation-strategy.",
                                    factory=list)
    cached_val_dataset: list[str] = opt(help="Tokenized validation rows (the export's OUT/val folder).", factory=list)
    split_dataset_ratio: float = opt(0.0, "Hold out this share of --dataset for validation.")
    max_length: int | None = opt(None, "Longest tokenized row, in tokens (longer ones: --truncation-strategy). "
                                 "Default: the model's context (max_position_embeddings), as in ms-swift.")
    truncation_strategy: str = opt("delete", "Rows longer than --max-length: delete (dropped and counted), left "
                                   "(keep the end), right (keep the start), or split (pt only, ms-swift's: "
                                   "consecutive --max-length pieces, each a sample).", choices=TRUNCATION)
    system: str | None = opt(None, "Default system prompt (text or a .txt file) for sft rows that have none; a "
                             "row's own system turn wins.")
    response_prefix: str | None = opt(None, "Text every generated answer starts with (ms-swift's; e.g. '<think>\\n'): "
                                      "written after the chat template's generation prompt, the model continues "
                                      "from it, the answer shown begins with it; \\n is a newline. Inference only, "
                                      "as in ms-swift: training rows are not changed; `swiftlite infer` on this run's "
                                      "checkpoints uses it (from args.json). Default: none beyond the chat "
                                      "template's own generation prompt.")
    loss_scale: str | None = opt(None, "Which tokens of a chat row are targets and their weights, ms-swift's names: "
                                 "default (every assistant turn; sft's default), last_round (the answers after the "
                                 "last user turn), all (every token, prompts too), then rules joined with +: "
                                 "ignore_empty_think (an empty <think></think> block opening an answer is no "
                                 "target), ignore_think_prefix (the opening <think> tag), and ms-swift's weighted "
                                 "agent scales hermes, react, qwen, agentflan, alpha_umi (e.g. hermes: each "
                                 "<tool_call> block weighs 2), e.g. last_round+ignore_empty_think. The loss is the "
                                 "sum of weight x cross-entropy over the targets / their number (ms-swift's). pt "
                                 "trains every token (all); rlhf the answer of each pair (last_round).")
    is_binary_loss_scale: bool | None = opt(None, "Whether the loss weights become labels only (a weight above 0: a "
                                            "target, weight 1). Default: binary unless --loss-scale names a "
                                            "weighted scale (ms-swift's rule); false keeps the weights that "
                                            "messages' own \"loss_scale\" fields give (ms-swift asks for it when "
                                            "one is above 1).")
    agent_template: str | None = opt(None, "How tool-calling rows (a tools column, tool_call / tool_response turns: "
                                     "ms-swift's agent format) are written before the chat template renders them: "
                                     "hermes (Qwen2.5's and Qwen3's tool format: tools in the system turn, "
                                     "<tool_call> JSON in the answer, <tool_response> in a user turn), react_en / "
                                     "react_zh (ms-swift's ReAct: the tool prompt as the system text, Action / "
                                     "Action Input / Observation in the answer, tool responses inside the answer's "
                                     "turn, not targets), react_grpo (ReAct with <think> reasoning, for GRPO's "
                                     "react_format and toolbench rewards). Required for such rows (sft, GRPO's "
                                     "prompts, GKD); ms-swift's other agent templates are not available.")
    packing: bool = opt(False, "Pack several rows into each sequence of --max-length tokens (rlhf dpo, orpo, "
                        "simpo, cpo: whole pairs, chosen and rejected together; a pack is one sample of the batch).")
    skip_bad_rows: bool = opt(False, "Skip (and count) rows that are not valid instead of stopping.")
    columns: dict[str, str] | None = opt(None, "Rename dataset columns before the row formats read them, as ms-swift: "
                                         "a JSON object old -> new, e.g. '{\"answer\": \"solution\"}' (every "
                                         "--dataset and --val-dataset row).")
    dataset_num_proc: int = opt(1, "Processes for dataset preprocessing.")
    model_name: list[str] | None = opt(None, "Self-cognition data (ms-swift's): fills {{NAME}} in the query and "
                                       "response of every row of a source in that format (query, response and tag "
                                       "columns): the first name in rows tagged zh, the second in the others; one "
                                       "name serves both. Refused when no source is in that format.")
    model_author: list[str] | None = opt(None, "Self-cognition data: fills {{AUTHOR}} the same way as --model-name "
                                         "fills {{NAME}} (e.g. --model-author 魔搭 ModelScope).")
    load_from_cache_file: bool = opt(False, "true: reuse tokenized data cached by an earlier run with the same "
                                     "files, tokenizer and options (SWIFTLITE_CACHE). false (ms-swift's default): "
                                     "tokenize again (the processes of this job then share that one result).")
    lazy_tokenize: bool = opt(False, "Tokenize each training row when a batch first needs it (in the DataLoader "
                              "workers with --dataloader-num-workers), not all before training; the same batches "
                              "as eager where every row is usable (a row without an answer or over --max-length "
                              "under delete keeps its place with no targets). Rows are still read and their format "
                              "checked up front. Not with --packing or --streaming (ms-swift's rules).")
    streaming: bool = opt(False, "Read and tokenize the training rows as training consumes them, in file order, "
                          "restarted at the end (JSONL and .txt files line by line, never whole in memory; other "
                          "formats are loaded, then streamed). "
                          "ms-swift's rules: --max-steps is required, `path#N` is the file's first N rows, no "
                          "--split-dataset-ratio (give --val-dataset); resume re-reads the stream to the "
                          "resumed position. With --packing the rows are packed as they are read, in order, "
                          "into packs of at most --max-length tokens.")
    padding_free: bool | None = opt(None, "Concatenate each micro-batch's rows into one sequence (position ids "
                                    "restart per row, no attention mask, no pad tokens; same samples and loss "
                                    "as padded batches). Default: on where the model's attention isolates rows "
                                    "by position ids (the run's first line says which, and why not); false pads. "
                                    "rlhf: padded unless true (dpo, orpo, simpo, cpo, grpo; ms-swift's default).")
