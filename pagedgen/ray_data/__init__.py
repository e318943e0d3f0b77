"""pagedgen as a Ray Data stage, in the shape of `ray.data.llm.build_processor`::

    import ray
    from pagedgen.ray_data import ProcessorConfig, build_processor

    config = ProcessorConfig(model="path/to/model", concurrency=4, batch_size=64,
                             engine_kwargs={"dtype": "bfloat16", "threads": 4})
    processor = build_processor(config, preprocess=lambda row: {"prompt": row["text"],
                                                               "max_tokens": 64})
    ds = processor(ray.data.read_text("s3://bucket/prompts.txt"))
    ds.write_parquet("s3://bucket/completions/")

Ray is imported only when a processor is built: `pip install 'pagedgen[ray]'`.
"""

from pagedgen.ray_data.config import ProcessorConfig
from pagedgen.ray_data.processor import Processor, build_processor

__all__ = ["ProcessorConfig", "Processor", "build_processor"]
