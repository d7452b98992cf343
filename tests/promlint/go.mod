module shoal.dev/tests/promlint

go 1.26.0

require github.com/prometheus/client_golang v1.25.0

require (
	github.com/munnerz/goautoneg v0.0.0-20191010083416-a7dc8b61c822 // indirect
	github.com/prometheus/client_model v0.6.3 // indirect
	github.com/prometheus/common v0.72.0 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
)
