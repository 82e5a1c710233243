"""The reference OpenAI-compatible gateway: routes each request on LookupRoute's hint."""
