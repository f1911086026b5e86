"""The trainer SDK (trainer process): ``WeightTransferTrainerFactory``, the HTTP client, weight sources, init infos, the send engines, TRL's client."""
