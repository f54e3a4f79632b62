"""Images in, text out: the prompts of vision-language models (engine.model.llava), their images as the model's own
Hugging Face image processor makes them (inputs: the prompt forms and image decoding; processor: token ids with the
placeholders expanded, pixel_values, mm hashes), and the encoder cache that keeps an image's features while its
prompt is prefilled (encoder_cache). The model runner merges the features into the input embeddings
(engine.worker.mm_embeds); the KV cache manager keys prefix-cache blocks by the images they hold.

Prompt forms (LLMEngine.generate / make_requests; any other prompt is text as before):

- `{"prompt": "What is in the picture?", "images": [img, ...]}`: one user turn, the images first (in order), then the
  text, through the model's chat template; with use_chat_template=False the text is raw and spells the model's image
  token (LLaVA: "<image>") once where each image goes.
- `{"messages": [...], "images": [img, ...]}` or a plain messages list: chat messages whose content is text or a
  list of parts, OpenAI's and HF's: {"type": "text", "text": ...}, {"type": "image"} (the next of "images"),
  {"type": "image", "image": img}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}.

An image `img` is a PIL.Image.Image, encoded bytes (PNG, JPEG, ... anything Pillow opens), a `data:` URL, or a
{"bytes": ...} dict (HF datasets' Image feature). Reading paths and http(s)/s3 URLs is the pipeline's job, not the
engine's. A text-only model given images raises ValueError before any work; a prompt whose images do not match its
placeholders, or an image Pillow cannot read, is an error output for that request alone.
"""
