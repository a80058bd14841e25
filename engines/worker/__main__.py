from engines.worker.server import main

main()
