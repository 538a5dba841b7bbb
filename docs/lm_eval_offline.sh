ecp export --ckpt runs/demo/ecp --out hf/ecp
python - <<'PY'
import json, pathlib, re, shutil, lm_eval
tasks = pathlib.Path("tasks")
tasks.mkdir(exist_ok=True)
text = pathlib.Path("wikitext-103-raw/wiki.test.raw").read_text(encoding="utf-8")
pages = re.split(r"\n(?= = [^=].* = \n)", text)  # an article starts at its " = Title = " line
with open(tasks / "wiki.test.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps({"page": page}) + "\n" for page in pages if page.strip())
shutil.copy(pathlib.Path(lm_eval.__file__).parent / "tasks/wikitext/preprocess_wikitext.py", tasks)
(tasks / "wikitext_local.yaml").write_text("""\
task: wikitext_local
dataset_path: json
dataset_kwargs: {data_files: {test: tasks/wiki.test.jsonl}}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ''
doc_to_target: !function preprocess_wikitext.wikitext_detokenizer
process_results: !function preprocess_wikitext.process_results
metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, {metric: bits_per_byte}]
""")
PY
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model hf \
  --model_args pretrained=hf/ecp,trust_remote_code=True --tasks wikitext_local \
  --include_path tasks --device cpu --output_path results
