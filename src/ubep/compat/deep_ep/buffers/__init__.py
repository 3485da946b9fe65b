"""DeepEP 2.1's `deep_ep.buffers` package: `legacy` (V1's `Buffer`, `Config`), `elastic`
(`ElasticBuffer`, `EPHandle`), and `xlayers`, whose `XLayerScheduler` ubep does not provide."""
